"""Local mode's shard count changes: a suspended run's checkpoints re-laid for another shard
count hold the same model and optimizer state bit for bit (embedding rows included),
training resumes at the same step, and a reshard killed after any change to the folder
loses nothing and finishes when run again."""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import yaml

from distbelief.operator.local import local, outputdir, resharding
from distbelief.operator.local.localpods import volume_dir
from distbelief.operator.render import podparts
from distbelief.runtime import contract
from distbelief.runtime.params.rows import rowcheckpoint
from distbelief.runtime.roles import reshard
from support.cli import run_cli
from support.examples import load_example
from support.localruns import chief_port, restored_steps, run_while, suspend_at, wait_for_step

pytestmark = pytest.mark.slow

STATE = ("params", "adagrad_accumulator")


def digits(shards: int) -> dict[str, Any]:
    doc = copy.deepcopy(load_example("digits-mlp.yaml"))
    doc["spec"]["parameterServers"]["shards"] = shards
    doc["spec"]["training"]["maxSteps"] = 3000
    return doc


@pytest.fixture(scope="module")
def suspended(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A digits run on 2 shards, suspended past step 800."""
    output = tmp_path_factory.mktemp("suspended")
    code, summary = suspend_at(digits(2), output, 800)
    assert code == 130 and summary["phase"] == "Suspended"
    yield output


def state(output: Path, shards: int) -> tuple[list[int], dict[str, np.ndarray]]:
    """The steps of the shards' newest checkpoints, and their state laid end to end."""
    return state_in([volume_dir(str(output), f"digits-ps-{shard}", contract.CHECKPOINT_VOLUME)
                     for shard in range(shards)])


def state_in(folders: list[str]) -> tuple[list[int], dict[str, np.ndarray]]:
    ckpts = [outputdir.newest(folder) for folder in folders]
    assert all(ckpts), f"a shard has no checkpoint in {folders}"
    return [c.step for c in ckpts], {name: np.concatenate([c.arrays[name] for c in ckpts]) for name in STATE}


def same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return all(a[name].tobytes() == b[name].tobytes() for name in STATE)


def test_a_suspended_run_resharded_holds_the_same_model_and_resumes_at_its_step(suspended: Path,
                                                                                 tmp_path: Path) -> None:
    output = tmp_path / "out"
    shutil.copytree(suspended, output)
    (chief_step, _), before = state(output, 2)

    done = run_cli("reshard", str(output), "--shards", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"resharded from 2 to 3 shards at step {chief_step}"
    steps_after, after = state(output, 3)
    assert steps_after == [chief_step] * 3 and same_bits(before, after)
    assert not (output / resharding.WORK).exists()
    assert (Path(volume_dir(str(output), "digits-ps-0", contract.CHECKPOINT_VOLUME)) / contract.HISTORY_FILE).exists()
    again = run_cli("reshard", str(output), "--shards", "3")
    assert again.stdout.strip() == f"{output}: already laid over 3 shards, at step {chief_step}", again.stderr
    assert state(output, 3)[0] == [chief_step] * 3

    # `distbelief run` with yet another count reshards by itself (3 -> 4), then trains on.
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(digits(4)))
    ran = run_cli("run", str(job), "--output", str(output), "--no-progress")
    assert ran.returncode == 0, ran.stderr
    assert f"resharded from 3 to 4 shards at step {chief_step}" in ran.stdout.splitlines()
    for shard in range(4):
        assert restored_steps(output / "logs" / f"digits-ps-{shard}.log")[0] == chief_step
    report = yaml.safe_load((output / "report.json").read_text())
    assert report["phase"] == "Succeeded" and report["accuracy"] > 0.9


def test_a_reshard_killed_after_any_change_loses_nothing_and_finishes_when_run_again(suspended: Path,
                                                                                      tmp_path: Path) -> None:
    _, before = state(suspended, 2)
    kills = 0
    while True:
        output = tmp_path / f"kill-{kills + 1}"
        shutil.copytree(suspended, output)
        done = run_cli("reshard", str(output), "--shards", "3", env={reshard.KILL_AFTER_ENV: str(kills + 1)})
        if done.returncode == 0:
            break   # the reshard made fewer changes than that: every kill point was tried
        assert done.returncode == -9, done.stderr
        kills += 1
        if not (output / resharding.WORK / reshard.PLAN).exists():
            # Without a plan to roll forward, the folder holds one whole layout: the old one
            # (killed before the commit point) or the new one (after the plan was done).
            assert _whole_layout(output, before) in (2, 3)
        again = run_cli("reshard", str(output), "--shards", "3")
        assert again.returncode == 0, again.stderr
        assert same_bits(state(output, 3)[1], before), f"killed after change {kills}"
        assert not (output / resharding.WORK).exists()
    # 3 staged checkpoints, the plan, 2 + 2 + 1 renames, the plan's removal
    assert kills == 10


def as_claims(suspended: Path, where: Path) -> list[Path]:
    """The run's two shard folders as a cluster job's checkpoint claims (each the root of its
    own, the first with a file system's lost+found), and a third, empty, for the new shard."""
    claims = []
    for pod in range(3):
        claim = where / f"claim-{pod}"
        if pod < 2:
            shutil.copytree(volume_dir(str(suspended), f"digits-ps-{pod}", contract.CHECKPOINT_VOLUME), claim)
        else:
            claim.mkdir(parents=True)
        claims.append(claim)
    (claims[0] / "lost+found").mkdir()
    return claims


def test_a_cluster_jobs_claims_resharded_and_killed_after_any_change_hold_the_same_model(suspended: Path,
                                                                                          tmp_path: Path) -> None:
    """`distbelief reshard-claims`, the operator's reshard Job: each claim's root is its
    shard's checkpoint folder, so the moves are per entry; a kill after any change, and the
    Job run again, gives the same model on 3 shards, and 3 -> 2 gives it back on 2."""
    config = volume_dir(str(suspended), "digits-ps-0", os.path.join(podparts.CONFIG_VOLUME, contract.CONFIG_KEY))
    steps, before = state(suspended, 2)
    kills = 0
    while True:
        claims = as_claims(suspended, tmp_path / f"kill-{kills + 1}")
        command = ("reshard-claims", *map(str, claims), "--config", config, "--shards", "3")
        done = run_cli(*command, env={reshard.KILL_AFTER_ENV: str(kills + 1)})
        if done.returncode != 0:
            assert done.returncode == -9, done.stderr
            kills += 1
            again = run_cli(*command)
            assert again.returncode == 0, again.stderr
        new_steps, after = state_in(list(map(str, claims)))
        assert same_bits(after, before) and set(new_steps) == {steps[0]}, f"killed after change {kills}"
        assert not [c for c in claims if (c / reshard.ClaimPlaces.WORK).exists()]
        if done.returncode == 0:
            break
    # 3 staged checkpoints, the plan, 2 claims set aside, 3 moved in, the plan's removal
    assert kills == 10
    assert (claims[0] / contract.HISTORY_FILE).is_file() and (claims[0] / "lost+found").is_dir()
    assert "resharded from 2 to 3" in done.stdout
    back = run_cli("reshard-claims", *map(str, claims), "--config", config, "--shards", "2")
    assert back.returncode == 0, back.stderr
    assert same_bits(state_in(list(map(str, claims[:2])))[1], before)
    assert sorted(os.listdir(claims[2])) == []
    empty = [tmp_path / f"empty-{pod}" for pod in range(3)]
    for claim in empty:
        claim.mkdir()
    nothing = run_cli("reshard-claims", *map(str, empty), "--config", config, "--shards", "3")
    assert (nothing.returncode, nothing.stdout.strip()) == (0, "no checkpoints to re-lay"), nothing.stderr


def _whole_layout(output: Path, before: dict[str, np.ndarray]) -> int | None:
    """The shard count whose checkpoints in output hold the state `before`, if any."""
    for shards in (2, 3):
        ckpts = [outputdir.newest(volume_dir(str(output), f"digits-ps-{s}", contract.CHECKPOINT_VOLUME))
                 for s in range(shards)]
        if all(ckpts) and sum(c.arrays["params"].size for c in ckpts) == before["params"].size \
                and same_bits(state(output, shards)[1], before):
            return shards
    return None


@pytest.fixture(scope="module")
def suspended_copies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A digits run on 2 shards with a backup each (pods 0-1 the shards' copy 0, 2-3 copy
    1), suspended past step 800."""
    output = tmp_path_factory.mktemp("copies")
    doc = digits(2)
    doc["spec"]["parameterServers"]["backups"] = 1
    code, summary = suspend_at(doc, output, 800)
    assert code == 130 and summary["phase"] == "Suspended"
    yield output


def pod_state(output: Path, pod: int) -> tuple[int, dict[str, np.ndarray]]:
    ckpt = outputdir.newest(volume_dir(str(output), f"digits-ps-{pod}", contract.CHECKPOINT_VOLUME))
    assert ckpt is not None, f"pod {pod} has no checkpoint in {output}"
    return ckpt.step, {name: ckpt.arrays[name] for name in STATE}


@pytest.mark.heavy
def test_a_job_with_shard_copies_resharded_seeds_every_copy_of_every_new_shard(suspended_copies: Path,
                                                                              tmp_path: Path) -> None:
    """Each shard is read from its copy with the newest checkpoint (a backup may lag), and
    both copies of each of the 3 new shards get its re-cut: the same bits, end to end, as the
    2 shards' newest state. The run then resumes at that step on 6 pods and succeeds."""
    output = tmp_path / "out"
    shutil.copytree(suspended_copies, output)
    newest = [max((pod_state(output, copy * 2 + shard) for copy in range(2)), key=lambda found: found[0])
              for shard in range(2)]
    before = {name: np.concatenate([state[name] for _, state in newest]) for name in STATE}
    done = run_cli("reshard", str(output), "--shards", "3")
    assert done.returncode == 0, done.stderr
    step = newest[0][0]
    assert done.stdout.strip() == f"resharded from 2 to 3 shards at step {step}"
    copies = [[pod_state(output, copy * 3 + shard) for shard in range(3)] for copy in range(2)]
    for laid in copies:
        assert [found_step for found_step, _ in laid] == [step] * 3
        assert same_bits({name: np.concatenate([state[name] for _, state in laid]) for name in STATE}, before)

    job = tmp_path / "job.yaml"
    doc = digits(3)
    doc["spec"]["parameterServers"]["backups"] = 1
    job.write_text(yaml.safe_dump(doc))
    ran = run_cli("run", str(job), "--output", str(output), "--no-progress")
    assert ran.returncode == 0, ran.stderr
    for pod in range(6):
        assert restored_steps(output / "logs" / f"digits-ps-{pod}.log")[0] == step, pod
    report = yaml.safe_load((output / "report.json").read_text())
    assert report["phase"] == "Succeeded" and report["accuracy"] > 0.9


def test_a_new_shard_count_with_backups_changed_too_is_refused_by_name_and_the_folder_kept(
        suspended_copies: Path, tmp_path: Path) -> None:
    output = tmp_path / "out"
    shutil.copytree(suspended_copies, output)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(digits(3)))     # no backups: the folder holds 4 shard pods
    ran = run_cli("run", str(job), "--output", str(output), "--no-progress")
    assert ran.returncode == 2
    assert ran.stderr.strip().splitlines()[-1] == (
        f"error: {output}: holds checkpoints of more than 2 shards x 1 copies (spec.parameterServers.backups "
        "changed?); reshard with the backups it ran with, or --fresh")
    assert not (output / resharding.WORK).exists()
    assert pod_state(output, 3)[0] > 0 and not Path(volume_dir(str(output), "digits-ps-4", "")).exists()


def ctr(shards: int) -> dict[str, Any]:
    doc = copy.deepcopy(load_example("ctr-sparse.yaml"))
    doc["spec"]["parameterServers"]["shards"] = shards
    doc["spec"]["training"]["maxSteps"] = 600
    return doc


def rows_and_dense(output: Path, shards: int) -> tuple[dict[int, bytes], dict[str, np.ndarray]]:
    """Every embedding row's state by key, read from the shards' newest checkpoints (and
    their row files) as a restore does, and the dense state laid end to end."""
    found: dict[int, bytes] = {}
    ckpts = []
    for shard in range(shards):
        folder = volume_dir(str(output), f"ctr-sparse-ps-{shard}", contract.CHECKPOINT_VOLUME)
        ckpt = outputdir.newest(folder)
        assert ckpt is not None, f"shard {shard} of {shards} has no checkpoint in {output}"
        ckpts.append(ckpt)
        for (keys, values, accumulators, touched), _ in rowcheckpoint.saved_parts(ckpt, folder, ckpt.meta["sparseDim"]):
            found.update({int(k): values[i].tobytes() + accumulators[i].tobytes() + touched[i].tobytes()
                          for i, k in enumerate(keys)})
    return found, {name: np.concatenate([c.arrays[name] for c in ckpts]) for name in STATE}


def test_a_suspended_job_with_embeddings_resharded_holds_every_row_and_trains_on(tmp_path: Path) -> None:
    output = tmp_path / "out"
    code, summary = suspend_at(ctr(2), output, 300)
    assert code == 130 and summary["phase"] == "Suspended"
    rows_before, dense_before = rows_and_dense(output, 2)
    assert len(rows_before) > 1000

    copied = tmp_path / "copied"
    shutil.copytree(output, copied)
    done = run_cli("reshard", str(copied), "--shards", "3")
    assert done.returncode == 0, done.stderr
    rows_after, dense_after = rows_and_dense(copied, 3)
    assert rows_after == rows_before and same_bits(dense_after, dense_before)

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(ctr(3)))
    ran = run_cli("run", str(job), "--output", str(output), "--no-progress")
    assert ran.returncode == 0, ran.stderr
    (announced,) = [line for line in ran.stdout.splitlines() if line.startswith("resharded from 2 to 3 shards")]
    step = int(announced.rsplit(" ", 1)[1])
    for shard in range(3):
        assert restored_steps(output / "logs" / f"ctr-sparse-ps-{shard}.log")[0] == step
    report = yaml.safe_load((output / "report.json").read_text())
    assert report["phase"] == "Succeeded" and report["globalStep"] >= 600, report


@pytest.mark.heavy
def test_a_partitioned_job_resharded_resumes_at_its_step_on_the_new_count(tmp_path: Path) -> None:
    """Each stage's parameters are re-cut over the stage's new shards (tests/unit/test_recut.py
    has the bits); the run resumes at the step on 4 shards and succeeds."""
    doc = copy.deepcopy(load_example("digits-partitioned.yaml"))
    doc["spec"]["training"]["maxSteps"] = 1500
    output = tmp_path / "out"
    code, summary = suspend_at(doc, output, 400)
    assert code == 130 and summary["phase"] == "Suspended"
    doc["spec"]["parameterServers"]["shards"] = 4
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    ran = run_cli("run", str(job), "--output", str(output), "--no-progress")
    assert ran.returncode == 0, ran.stderr
    (line,) = [line for line in ran.stdout.splitlines() if line.startswith("resharded from 2 to 4 shards at step ")]
    step = int(line.rsplit(" ", 1)[1])
    name = doc["metadata"]["name"]
    for shard in range(4):
        assert restored_steps(output / "logs" / f"{name}-ps-{shard}.log")[0] == step, shard
    report = yaml.safe_load((output / "report.json").read_text())
    assert report["phase"] == "Succeeded"


@pytest.mark.heavy
@pytest.mark.parametrize("every_seconds, newest", [(3600, "none"), (1, r"step \d+")])
def test_a_journal_holding_what_no_checkpoint_does_is_replayed_on_the_old_count_before_a_reshard(
        tmp_path: Path, every_seconds: int, newest: str) -> None:
    """A journaled job's shards SIGKILLed (with no checkpoint yet, or since their last), and
    the run stopped before they came back: their journals hold acknowledged commands that no
    checkpoint does. A reshard refuses by name and changes nothing; run on its count, the
    shards replay them; suspended, the job reshards (each new shard starting a journal of its
    own) and resumes at its step."""
    doc = digits(2)
    doc["spec"]["parameterServers"].update(journal=True, checkpoint={"everySeconds": every_seconds})
    output = tmp_path / "out"

    def sigkill_the_shards(run: local.LocalRun) -> None:
        wait_for_step(chief_port(run), 600)
        for shard in run.shards:
            shard.process.send_signal(signal.SIGKILL)
        run.interrupt()   # at once: a killed pod restarts after a second's back-off

    run_while(doc, output, sigkill_the_shards, timeout=60)
    shard_0 = volume_dir(str(output), "digits-ps-0", contract.CHECKPOINT_VOLUME)
    assert (outputdir.newest(shard_0) is None) == (newest == "none")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**doc, "spec": {**doc["spec"], "parameterServers": {
        **doc["spec"]["parameterServers"], "shards": 3}}}))
    refused = run_cli("run", str(job), "--output", str(output), "--no-progress")
    assert refused.returncode == 2
    named = re.search(r"the shard journal in (\S+) holds \d+ acknowledged commands after its newest checkpoint "
                      r"\((none|step \d+)\)", refused.stderr)
    assert named and re.fullmatch(newest, named.group(2)), refused.stderr
    (killed,) = [shard for shard in range(2)
                 if named.group(1) == volume_dir(str(output), f"digits-ps-{shard}", contract.CHECKPOINT_VOLUME)]
    assert not (output / resharding.WORK).exists() and not (output / "volumes" / "digits-ps-2").exists()

    code, summary = suspend_at(doc, output, 900)
    assert code == 130 and summary["phase"] == "Suspended", summary
    replayed = re.findall(r"event=journal_replayed shard=\d+ from_seq=\d+ commands=(\d+)",
                          (output / "logs" / f"digits-ps-{killed}.log").read_text())
    assert replayed and int(replayed[-1]) > 0, (killed, replayed)
    (chief_step, _), _ = state(output, 2)
    ran = run_cli("run", str(job), "--output", str(output), "--no-progress")
    assert ran.returncode == 0, ran.stderr
    assert f"resharded from 2 to 3 shards at step {chief_step}" in ran.stdout.splitlines()
    for shard in range(3):
        assert restored_steps(output / "logs" / f"digits-ps-{shard}.log")[-1] == chief_step, shard
    report = yaml.safe_load((output / "report.json").read_text())
    assert report["phase"] == "Succeeded" and report["accuracy"] > 0.9, report
