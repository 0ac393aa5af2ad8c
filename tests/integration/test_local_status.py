"""Local mode ends a job through the operator's compute_status: what it observes of its
processes maps onto the same phases, reasons and counting as on a cluster."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distbelief.operator.local import local
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import scrape
from distbelief.operator.status.status import timestamp

from support.examples import load_example
from support.paths import TESTS


def _exited(code: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"])
    process.wait()
    return process


def _running() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.fixture
def run(tmp_path: Path):
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["runPolicy"]["backoffLimit"] = 2
    live = local.LocalRun(DistBeliefJob.validated(doc), str(tmp_path))
    for pod in live.pods:
        pod.process = _running()
    yield live
    for pod in live.pods:
        if pod.process.poll() is None:
            pod.process.kill()
            pod.process.wait()


def _crash(pod: local.LocalPod, code: int, restarts: int, last_line: str = "") -> None:
    pod.process.kill()
    pod.process.wait()
    pod.process, pod.exit_code, pod.restarts = _exited(code), None, restarts
    Path(pod.log_path).write_text(f"starting\n{last_line}\n")


def _condition(status: dict, phase: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == phase)


def test_replicas_restart_without_limit_as_a_deployments_do(run: local.LocalRun) -> None:
    _crash(run.workers[0], 1, restarts=50)
    assert run._status(scrape.Figures())["phase"] == "Running"


def test_a_shard_past_backoff_limit_fails_the_job_saying_how_it_ended(run: local.LocalRun) -> None:
    _crash(run.shards[1], 1, restarts=1, last_line="error: shard 0 at tcp://x did not answer")
    assert run._status(scrape.Figures())["phase"] == "Pending"  # its coming restart is the 2nd: at the limit
    run.shards[1].restarts = 2
    status = run._status(scrape.Figures())
    failed = _condition(status, "Failed")
    assert status["phase"] == "Failed" and failed["reason"] == "BackoffLimitExceeded"
    assert "digits-ps-1 exited with code 1; last log line: error: shard 0 at tcp://x did not answer" in failed["message"]
    assert run._ending(status) == ("Failed", f"BackoffLimitExceeded: {failed['message']}")


def test_a_pod_with_a_config_error_fails_the_job_at_once(run: local.LocalRun) -> None:
    _crash(run.workers[2], 2, restarts=0, last_line="error: npz:/d.npz: x holds 1 non-finite values")
    status = run._status(scrape.Figures())
    assert run._ending(status) == ("Failed", "InvalidConfig: digits-worker-2: error: npz:/d.npz: x holds 1 "
                                             "non-finite values")
    run._restart_crashed()
    assert run.workers[2].restart_at == 0.0, "a config error was scheduled for a restart"


def test_the_chiefs_verdict_is_the_phase(run: local.LocalRun) -> None:
    for pod in run.pods:  # the shards and replicas exit by themselves once the chief ends the job
        pod.process.kill()
        pod.process.wait()
        pod.process = _exited(0)
    figures = scrape.Figures(global_step=8000, finished_outcome="Succeeded", finished_reason="MaxStepsReached")
    status = run._status(figures)
    assert run._ending(status) == ("Succeeded", "MaxStepsReached")


def test_a_silent_job_past_max_duration_fails_with_the_operators_grace(run: local.LocalRun) -> None:
    start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=10, seconds=30)
    run.status = {"startTime": timestamp(start)}  # maxDuration 10m: still within the 60 s grace
    assert run._status(scrape.Figures())["phase"] == "Running"
    run.status = {"startTime": timestamp(start - datetime.timedelta(minutes=1))}
    status = run._status(scrape.Figures())
    assert status["phase"] == "Failed" and _condition(status, "Failed")["reason"] == "DeadlineExceeded"


@pytest.mark.slow
def test_a_loss_that_stays_non_finite_fails_the_job_naming_the_replica(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["model"] = {"entrypoint": "user_model:build_diverging"}
    doc["spec"]["training"]["maxSteps"] = 10_000_000
    code = local.LocalRun(DistBeliefJob.validated(doc), str(tmp_path)).run(progress=False)
    summary = json.loads((tmp_path / "report.json").read_text())
    assert code == 1 and summary["phase"] == "Failed"
    assert re.match(r"NonFiniteLoss: digits-worker-\d: error: the training loss was nan for 3 pushes in a row, "
                    r"at global step \d+ \(this replica's minibatch \d+\): lower spec.training.learningRate",
                    summary["reason"]), summary["reason"]
    assert summary["restartsByPod"]["digits-worker-0"] == 0  # a diverged replica is not restarted
