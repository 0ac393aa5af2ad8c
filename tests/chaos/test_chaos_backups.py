"""Chaos with shard copies: local-mode runs with spec.parameterServers.backups: 1 while a
seeded killer SIGKILLs shard processes, primaries and backups, each time its shard has both
copies in sync again. Nothing acknowledged may be lost: the job succeeds, the chief's
evaluated step never goes back, and each shard's final step is exactly the number of
pushes the replicas were told it applied (the digits job), or every shard applied the same
steps (a partitioned job, whose steps commit on every shard or on none). The figures are
recorded in docs/reliability.md."""

from __future__ import annotations

import copy
import json
import logging
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from distbelief.operator.local import local, report
from distbelief.runtime import contract
from distbelief.runtime.shard import checkpoint

from support.examples import load_example
from support.fire import run_under_fire
from support.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import copycheck

pytestmark = pytest.mark.slow

log = logging.getLogger(__name__)

SEED = 19
KILLS = 10
MAX_STEPS = 24000
KILL_UNTIL_STEP = 21000   # the kills must all land before this step (the run ends at MAX_STEPS)
PAUSE = (0.2, 0.8)        # seconds between a shard's copies being in sync and the next kill
PRIMARY, BACKUP = 2, 1    # distbelief_copy_role


def chaos_job() -> dict[str, Any]:
    doc = copy.deepcopy(load_example("digits-mlp.yaml"))
    doc["spec"]["training"]["maxSteps"] = MAX_STEPS
    doc["spec"]["parameterServers"]["backups"] = 1
    doc["spec"]["workers"]["replicas"] = 2
    doc["spec"]["runPolicy"]["backoffLimit"] = 20
    return doc


def shard_in_sync(run: local.LocalRun, shard: int) -> dict[str, dict[str, float]] | None:
    """The figures of both copies of shard, when one is primary with both copies in sync."""
    pods = [pod for pod in run.shards if run_config(run).copy_of(_ordinal(pod))[0] == shard]
    seen = {pod.name: copycheck.figures(pod) for pod in pods if pod.running}
    if len(seen) != len(pods) or any(f is None or "role" not in f for f in seen.values()):
        return None
    roles = sorted(f["role"] for f in seen.values())
    in_sync = roles == [BACKUP, PRIMARY] and all(f["copies"] == 2 for f in seen.values() if f["role"] == PRIMARY)
    return seen if in_sync else None  # type: ignore[return-value]


def run_config(run: local.LocalRun) -> contract.JobConfig:
    return run.job.config


def _ordinal(pod: local.LocalPod) -> int:
    return contract.shard_index_from_pod_name(pod.name)


def kill_copies(run: local.LocalRun, thread: threading.Thread, rng: random.Random, *, count: int = KILLS,
                until_step: int = KILL_UNTIL_STEP, from_step: int = 0) -> list[dict[str, Any]]:
    """SIGKILL `count` shard pods: each time a shard at random, once its two copies are in
    sync (so each kill leaves one copy with every acknowledged update), and the copy of it
    killed least so far, or one at random (a pod's restart back-off doubles with each crash);
    all from from_step (training under way) and before until_step."""
    kills: list[dict[str, Any]] = []
    started = time.monotonic()
    shards = run_config(run).spec.parameter_servers.shards
    while len(kills) < count and thread.is_alive():
        time.sleep(rng.uniform(*PAUSE))
        shard = rng.randrange(shards)
        seen = shard_in_sync(run, shard)
        if seen is None:
            continue
        fewest = min(sum(k["pod"] == name for k in kills) for name in seen)
        name = rng.choice(sorted(n for n in seen if sum(k["pod"] == n for k in kills) == fewest))
        step = max(f["step"] for f in seen.values())
        if step < from_step:
            continue
        assert step < until_step, f"the run reached step {step} after {len(kills)} kills: raise maxSteps"
        pod = next(p for p in run.shards if p.name == name)
        pod.process.send_signal(signal.SIGKILL)
        kill = {"pod": name, "shard": shard, "primary": seen[name]["role"] == PRIMARY, "step": int(step),
                "at": round(time.monotonic() - started, 1)}
        kills.append(kill)
        log.info("chaos kill %s", kill)
    return kills


def acknowledged(output: Path, shards: int) -> list[int]:
    """Pushes the replicas were told each shard applied, from their exit lines."""
    totals = [0] * shards
    for path in (output / "logs").glob("*-worker-*.log"):
        (line,) = re.findall(r"event=worker_exit .* pushes_acknowledged=([\d,]+)", path.read_text())
        totals = [t + int(n) for t, n in zip(totals, line.split(","))]
    return totals


def final_steps(output: Path, run: local.LocalRun) -> list[int]:
    """Each shard's newest checkpoint step over its copies (each writes one as it ends)."""
    config = run_config(run)
    steps = [0] * config.spec.parameter_servers.shards
    for pod in run.shards:
        shard = config.copy_of(_ordinal(pod))[0]
        folder = output / "volumes" / pod.name / contract.CHECKPOINT_VOLUME
        newest = checkpoint.list_checkpoints(str(folder))[:1]
        steps[shard] = max([steps[shard], *(checkpoint.step_of(p) for p in newest)])
    return steps


def test_sigkills_of_shard_copies_lose_no_acknowledged_update(tmp_path: Path) -> None:
    output = tmp_path / "chaos"
    started = time.monotonic()
    run, codes, kills = run_under_fire(chaos_job(), output,
                                       lambda run, thread: kill_copies(run, thread, random.Random(SEED)))
    summary = json.loads((output / report.REPORT_FILE).read_text())
    history = report.read_history(str(output / "volumes" / run.shards[0].name / contract.CHECKPOINT_VOLUME))
    measured = {"kills": kills, "wallSeconds": round(time.monotonic() - started, 1), "shards": summary.get("shards"),
                "acknowledged": acknowledged(output, 2), "finalSteps": final_steps(output, run)}
    print(json.dumps(measured))

    assert codes == [0] and summary["phase"] == "Succeeded", summary
    assert len(kills) == KILLS
    assert {k["primary"] for k in kills} == {True, False}, "the seed must kill primaries and backups"
    for name, restarts in summary["restartsByPod"].items():
        assert restarts == sum(k["pod"] == name for k in kills), name
    # Nothing acknowledged was lost, nothing applied twice: each shard's final step is the
    # number of pushes its replicas were told it applied.
    assert measured["finalSteps"] == measured["acknowledged"], measured
    # Every push goes to every shard: their final steps differ by the pushes the replicas
    # had out when the job ended, at most one each.
    assert max(measured["finalSteps"]) - min(measured["finalSteps"]) <= chaos_job()["spec"]["workers"]["replicas"]
    assert summary["globalStep"] >= MAX_STEPS
    # The chief's evaluated step never went back, even across kills of its own pod.
    steps = [row["step"] for row in history]
    assert steps == sorted(steps), steps
    # Every primary killed was replaced by its backup: one failover each.
    for shard in range(2):
        primaries_killed = sum(k["primary"] and k["shard"] == shard for k in kills)
        assert summary["shards"][str(shard)]["failovers"] == primaries_killed, (shard, summary["shards"])


PARTITIONED_KILLS = 6
PARTITIONED_STEPS = 4000


def partitioned_job() -> dict[str, Any]:
    doc = copy.deepcopy(load_example("digits-partitioned.yaml"))
    doc["spec"]["training"]["maxSteps"] = PARTITIONED_STEPS
    doc["spec"]["parameterServers"]["backups"] = 1
    doc["spec"]["parameterServers"]["checkpoint"]["everySeconds"] = 2
    doc["spec"]["runPolicy"]["backoffLimit"] = 20
    return doc


def test_sigkills_of_shard_copies_leave_no_partitioned_step_half_applied(tmp_path: Path) -> None:
    """Each step of a partitioned replica is held on every shard, pinned, then applied: a
    primary killed anywhere in it leaves its backup holding every hold and pin it
    acknowledged, so the step still commits everywhere or nowhere. Without replicated holds
    a promoted backup refuses APPLY_HELD for a step the other shard applied."""
    output = tmp_path / "chaos"
    doc = partitioned_job()
    run, codes, kills = run_under_fire(doc, output, lambda run, thread: kill_copies(
        run, thread, random.Random(SEED), count=PARTITIONED_KILLS, from_step=PARTITIONED_STEPS // 10,
        until_step=PARTITIONED_STEPS * 5 // 6))
    summary = json.loads((output / report.REPORT_FILE).read_text())
    steps = final_steps(output, run)
    print(json.dumps({"kills": kills, "finalSteps": steps, "shards": summary.get("shards")}))
    assert codes == [0] and summary["phase"] == "Succeeded", summary
    assert len(kills) == PARTITIONED_KILLS and any(k["primary"] for k in kills), kills
    # Every step commits on every shard; when the job ends, a group's last APPLY_HELD may
    # reach one shard before the chief's DONE and the other after it.
    assert max(steps) - min(steps) <= doc["spec"]["workers"]["replicas"], steps
    assert summary["globalStep"] >= PARTITIONED_STEPS
    history = report.read_history(str(output / "volumes" / run.shards[0].name / contract.CHECKPOINT_VOLUME))
    assert [row["step"] for row in history] == sorted(row["step"] for row in history)
