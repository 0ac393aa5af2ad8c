"""Chaos: one local-mode run of the digits job while a seeded killer SIGKILLs shard and
replica processes at random moments. The job must still finish, as accurate as a clean
run of the same job, with every checkpoint intact and no shard resuming from before its
last checkpoint. The figures measured here are recorded in docs/reliability.md."""

from __future__ import annotations

import copy
import json
import logging
import random
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from distbelief.operator.local import local, report
from distbelief.operator.status import scrape
from distbelief.runtime import contract
from distbelief.runtime.shard import checkpoint

from support.examples import load_example
from support.fire import run_under_fire

pytestmark = pytest.mark.slow

log = logging.getLogger(__name__)

SEED = 8
KILLS = 12
MAX_STEPS = 16000
CHECKPOINT_EVERY = 1
KILL_FROM_STEP = 300       # let every pod start before the first kill
KILL_UNTIL_STEP = 12000    # leave the last stretch to reach the plateau again; wide enough that
                           # a fast machine still fits KILLS pauses in the window
PAUSE = (0.3, 1.2)         # seconds between kills, drawn from the seeded RNG


def chaos_job() -> dict[str, Any]:
    doc = copy.deepcopy(load_example("digits-mlp.yaml"))
    doc["spec"]["training"]["maxSteps"] = MAX_STEPS
    doc["spec"]["parameterServers"]["checkpoint"]["everySeconds"] = CHECKPOINT_EVERY
    doc["spec"]["runPolicy"]["backoffLimit"] = 10
    return doc


def figures(pod: local.LocalPod) -> scrape.Figures:
    return scrape.read(f"http://127.0.0.1:{pod.ports[contract.METRICS_PORT_NAME]}/metrics")


def chief_step(run: local.LocalRun) -> int:
    return figures(run.shards[0]).global_step or 0


def kill_at_random(run: local.LocalRun, thread: threading.Thread, rng: random.Random) -> list[dict[str, Any]]:
    """SIGKILL KILLS running pods, chosen and spaced by rng, while the chief's step is in
    [KILL_FROM_STEP, KILL_UNTIL_STEP]. A shard is scraped just before its kill: its step
    then, and the step of its newest checkpoint."""
    kills: list[dict[str, Any]] = []
    while len(kills) < KILLS and thread.is_alive():
        time.sleep(rng.uniform(*PAUSE))
        try:
            step = chief_step(run)
        except Exception:
            continue  # shard 0 is itself restarting
        if step < KILL_FROM_STEP:
            continue
        if step > KILL_UNTIL_STEP:
            break
        pod = rng.choice(run.pods)
        if not pod.running:
            continue
        kill: dict[str, Any] = {"pod": pod.name, "role": pod.role, "chiefStep": step}
        if pod in run.shards:
            seen = figures(pod)
            if not seen.reachable or seen.checkpoint_step is None:
                continue  # restarted, not serving yet
            kill.update(step=seen.global_step, checkpointStep=seen.checkpoint_step)
        pod.process.send_signal(signal.SIGKILL)
        kills.append(kill)
        log.info("chaos kill %s", kill)
    return kills


def restart_steps(log_path: Path) -> list[int]:
    """The step each restart of a shard began from. Every start logs either a restore or,
    when the shard was killed before its first checkpoint, a fresh start (step 0); the
    first start of all is not a restart."""
    starts = re.finditer(r"event=(?:restored shard=\d+ step=(\d+)|fresh_start)", log_path.read_text())
    return [int(m.group(1) or 0) for m in starts][1:]


def checkpoint_steps(log_path: Path) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"event=checkpoint shard=\d+ step=(\d+)", log_path.read_text())]


def test_random_sigkills_of_shards_and_replicas_lose_nothing_but_the_last_interval(tmp_path: Path) -> None:
    # The clean run of the same job: the accuracy the chaos run must match.
    _, clean_codes, _ = run_under_fire(chaos_job(), tmp_path / "clean", lambda run, thread: [])
    assert clean_codes == [0]
    clean_summary = json.loads((tmp_path / "clean" / report.REPORT_FILE).read_text())

    output = tmp_path / "chaos"
    run, codes, kills = run_under_fire(chaos_job(), output,
                                       lambda run, thread: kill_at_random(run, thread, random.Random(SEED)))
    summary = json.loads((output / report.REPORT_FILE).read_text())

    # The job completed, despite every kill, and all of them landed.
    assert codes == [0] and summary["phase"] == "Succeeded", summary
    assert len(kills) >= 10, kills  # aims at KILLS; a slow machine may finish the window first
    shard_kills = [k for k in kills if k["role"] == contract.ROLE_PS]
    assert shard_kills and len(shard_kills) < KILLS, "the seed must kill both roles"
    for name, restarts in summary["restartsByPod"].items():
        assert restarts == sum(k["pod"] == name for k in kills), name
    assert summary["globalStep"] >= MAX_STEPS

    # As accurate as the clean run. The held-out set has 359 examples: at 98 % accuracy one
    # run's figure has a standard deviation of 0.7 points, a difference of two runs about
    # 0.9, so "within one point" failed about one run in four by chance alone. Within 2.5
    # points (below 3 standard deviations), and both above the example's own bar.
    assert clean_summary["accuracy"] >= 0.95 and summary["accuracy"] >= 0.95, (summary, clean_summary)
    assert abs(summary["accuracy"] - clean_summary["accuracy"]) <= 0.025, (summary, clean_summary)

    # Each shard resumed from its newest checkpoint: what a kill loses is at most the
    # updates applied since that checkpoint, and a shard's checkpoints never go back.
    lost: list[int] = []
    for shard in run.shards:
        shard_log = output / "logs" / f"{shard.name}.log"
        mine = [k for k in shard_kills if k["pod"] == shard.name]
        restored = restart_steps(shard_log)
        assert len(restored) == len(mine), (shard.name, restored, mine)
        for kill, step in zip(mine, restored):
            assert step >= kill["checkpointStep"], (kill, step)
            lost.append(max(0, kill["step"] - step))
        saved = checkpoint_steps(shard_log)
        assert saved == sorted(saved), (shard.name, saved)
        assert "event=checkpoint_corrupt" not in shard_log.read_text()

    # Every checkpoint left on the volumes verifies; none was set aside as corrupt.
    files = sorted((output / "volumes").glob(f"*/{contract.CHECKPOINT_VOLUME}/*"))
    assert not [f for f in files if f.name.endswith(".corrupt")]
    ckpts = [f for f in files if f.name.endswith(checkpoint.SUFFIX)]
    assert len(ckpts) >= len(run.shards)
    for path in ckpts:
        ckpt = checkpoint.load(str(path))
        assert f"-ps-{ckpt.shard}/" in str(path)

    # What the chief saw: the evaluated step may dip after shard 0 restarts (it resumes
    # from its checkpoint), never below the step of a checkpoint shard 0 had written.
    history = [json.loads(line) for line in (output / run.chief_dir.split(str(output) + "/")[1]
                                             / contract.HISTORY_FILE).read_text().splitlines()]
    steps = [h["step"] for h in history]
    dips = [(a, b) for a, b in zip(steps, steps[1:]) if b < a]
    assert len(dips) <= sum(k["pod"] == run.shards[0].name for k in shard_kills)

    print(json.dumps({"kills": kills, "lostPerShardKill": lost, "historyDips": dips,
                      "accuracy": {"clean": clean_summary["accuracy"], "chaos": summary["accuracy"]},
                      "wallSeconds": {"clean": clean_summary["wallSeconds"], "chaos": summary["wallSeconds"]},
                      "checkpointFiles": [f.name for f in files]}, indent=1))


WRITER = """
import sys
import numpy as np
from distbelief.runtime.shard import checkpoint
folder, size = sys.argv[1], int(sys.argv[2])
params = np.zeros(size, dtype=np.float32)
step = 0
while True:  # one checkpoint after another, each one step on, until killed
    step += 1
    params[:] = step
    checkpoint.save(folder, checkpoint.Checkpoint(step=step, layout=7, shard=0, arrays={"params": params},
                                                  meta={}), keep=3)
"""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # renamed into place meanwhile
        return 0


def test_a_sigkill_in_the_middle_of_a_checkpoint_write_leaves_the_previous_one_usable(tmp_path: Path) -> None:
    """A process writing large checkpoints back to back is killed while a partial file
    (the temporary) is on disk; the newest complete checkpoint must still verify and win."""
    import subprocess
    import sys

    size = 8_000_000  # 32 MB per checkpoint: the write is long enough to be caught in flight
    caught = 0
    for attempt in range(20):  # a loaded machine may let the rename win a few times
        folder = tmp_path / f"ckpt-{attempt}"
        folder.mkdir()
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(size)])
        try:
            while writer.poll() is None:
                partial = [p for p in folder.iterdir() if p.name.endswith(".tmp") and _size(p) > 0]
                if partial and checkpoint.list_checkpoints(str(folder)):
                    writer.send_signal(signal.SIGKILL)
                    break
        finally:
            writer.kill()
            writer.wait()
        leftovers = [p for p in folder.iterdir() if p.name.endswith(".tmp")]
        complete = checkpoint.list_checkpoints(str(folder))
        if not leftovers:
            continue  # the rename won the race: nothing half-written to test against
        caught += 1
        newest = int(Path(complete[0]).name[5:17])
        torn = int(leftovers[0].name[6:18])
        assert torn == newest + 1, (leftovers, complete)  # the kill hit the next write
        ckpt = checkpoint.restore_latest(str(folder), layout=7, shard=0)
        assert ckpt is not None and ckpt.step == newest
        assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]  # the torn write is gone
        assert float(ckpt.arrays["params"][0]) == newest and float(ckpt.arrays["params"][-1]) == newest
        assert not [p for p in folder.iterdir() if p.name.endswith(".corrupt")]
        for path in complete:
            checkpoint.load(path)
        break
    assert caught == 1, "no kill landed while a checkpoint was being written"
