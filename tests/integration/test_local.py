"""Local mode end to end: real shard and replica processes on loopback, as `distbelief run`
starts them, including killed and restarted pods."""

from __future__ import annotations

import copy
import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distbelief.operator.local import local, report
from distbelief.runtime import contract

from support.examples import load_example
from support.localruns import chief_port, restored_steps, run_job, run_while, suspend_at, wait_for_step

pytestmark = pytest.mark.slow


@pytest.mark.floors
def test_digits_example_trains_to_095_and_leaves_a_report(tmp_path: Path) -> None:
    code, summary = run_job(load_example("digits-mlp.yaml"), tmp_path)
    assert code == 0
    assert summary["phase"] == "Succeeded"
    assert summary["accuracy"] >= 0.95
    assert summary["globalStep"] >= load_example("digits-mlp.yaml")["spec"]["training"]["maxSteps"]
    assert summary["examplesPerSecond"] > 0 and summary["wallSeconds"] > 0
    assert summary["restarts"] == 0
    _every_pod_reports_its_memory_and_traffic(summary, shards=2, workers=3)
    assert (tmp_path / report.PLOT_FILE).read_bytes().startswith(b"\x89PNG")
    rows = [json.loads(line) for line in (tmp_path / "curves.jsonl").read_text().splitlines()]
    assert rows[0] == {"time": rows[0]["time"], "event": "start", "step": 0}
    training = [row for row in rows if "trainLoss" in row]
    assert training and all(row["examplesPerSecondPerReplica"] > 0 for row in training[1:])
    # Each replica's own rate (a row lacks a replica whose scrape missed that record or the one before).
    assert len({name for row in training[2:] for name in row["replicaExamplesPerSecond"]}) == 3
    assert all(len(row["replicaExamplesPerSecond"]) <= 3 for row in training)
    assert all(0 < row["trainLoss"] < 10 for row in training)
    assert [row["step"] for row in training] == sorted(row["step"] for row in training)
    [history] = (tmp_path / "volumes").glob(f"digits-ps-0/{contract.CHECKPOINT_VOLUME}/{contract.HISTORY_FILE}")
    evaluations = [json.loads(line) for line in history.read_text().splitlines()]
    working = [row for row in evaluations if row["replicas"]]  # the chief's history, on a cluster too
    assert working and all(0 < row["trainLoss"] < 10 and row["replicas"] <= 3 for row in working)
    assert max(row["replicas"] for row in working) == 3
    assert all(row["examplesPerSecondPerReplica"] == pytest.approx(row["examplesPerSecond"] / row["replicas"])
               for row in working)
    shard_logs = sorted((tmp_path / "logs").glob("digits-ps-*.log"))
    assert len(shard_logs) == 2
    for log in shard_logs:  # the shards ran with the job's keys
        assert "auth=curve" in log.read_text() and "event=unauthenticated" not in log.read_text()
    with np.load(tmp_path / contract.PARAMS_FILE) as params:
        assert params["layer0.weight"].shape == (64, 64)
        assert params["layer1.weight"].shape == (64, 10)


@pytest.mark.heavy
def test_digits_with_a_bfloat16_wire_trains_as_well_as_float32_on_half_the_traffic(tmp_path: Path) -> None:
    runs = {}
    for wire_format in ("float32", "bfloat16"):
        doc = load_example("digits-mlp.yaml")
        doc["spec"]["parameterServers"]["wireFormat"] = wire_format
        code, runs[wire_format] = run_job(doc, tmp_path / wire_format)
        assert code == 0 and runs[wire_format]["phase"] == "Succeeded"
    assert runs["bfloat16"]["accuracy"] >= 0.95
    assert runs["bfloat16"]["accuracy"] >= runs["float32"]["accuracy"] - 0.02
    # Every step a replica pushes its gradient and pulls the parameters back (fetchEvery =
    # pushEvery = 1): the replicas' bytes per applied step are about halved.
    per_step = {fmt: sum(pod["bytesIn"] + pod["bytesOut"] for name, pod in run["pods"].items() if "worker" in name)
                / run["globalStep"] for fmt, run in runs.items()}
    assert per_step["bfloat16"] < 0.6 * per_step["float32"]


def _every_pod_reports_its_memory_and_traffic(summary: dict[str, Any], *, shards: int, workers: int) -> None:
    pods = summary["pods"]
    assert sorted(pods) == [f"digits-ps-{i}" for i in range(shards)] + [f"digits-worker-{i}" for i in range(workers)]
    for name, pod in pods.items():
        assert pod["peakRssBytes"] > 30 << 20, name  # an interpreter with numpy and ZeroMQ, at least
        assert pod["bytesIn"] > 0 and pod["bytesOut"] > 0, name
        assert pod["memoryLimit"] == "1Gi" and pod["oomKills"] == 0, name
        assert pod["restarts"] == summary["restartsByPod"][name]
    # Each replica pulled the model (64*64+64 + 64*10+10 floats) many times; shard 0 also ran the chief.
    model_bytes = 4 * (64 * 64 + 64 + 64 * 10 + 10)
    assert all(pods[f"digits-worker-{i}"]["bytesIn"] > 100 * model_bytes for i in range(workers))
    # Every byte one pod sent, another received: the counts agree but for what moved after
    # a pod's last scrape (or was lost with a killed one).
    sent, received = (sum(pod[key] for pod in pods.values()) for key in ("bytesOut", "bytesIn"))
    assert received == pytest.approx(sent, rel=0.05)


def test_fetch_and_push_every_n_steps_still_converge(tmp_path: Path) -> None:
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["training"].update(fetchEvery=3, pushEvery=2, maxSteps=3000, targetAccuracy=0.95)
    code, summary = run_job(doc, tmp_path)
    assert code == 0 and summary["accuracy"] >= 0.95


def test_the_partitioned_example_trains_with_a_pod_per_partition_of_each_replica(tmp_path: Path) -> None:
    doc = load_example("digits-partitioned.yaml")
    doc["spec"]["training"].update(maxSteps=4000, targetAccuracy=0.95)
    code, summary = run_job(doc, tmp_path)
    assert code == 0 and summary["accuracy"] >= 0.95, summary
    workers = sorted(pod for pod in summary["restartsByPod"] if "-worker-" in pod)
    assert workers == [f"digits-partitioned-worker-p{k}-{i}" for k in (0, 1) for i in range(3)]
    # Each pod computed its own stage in a group, or (started late, on a busy machine) found
    # the job already at its target: then it ended with the job, having trained nothing.
    joined = {k: 0 for k in "01"}
    for pod in workers:
        partition, log = pod.split("-p")[-1].split("-")[0], (tmp_path / "logs" / f"{pod}.log").read_text()
        if f"event=group_joined partition={partition} " in log:
            joined[partition] += 1
        else:
            assert "steps=0 pushes_acknowledged=- reason=done" in log, (pod, log[-2000:])
    assert min(joined.values()) >= 2, joined


def test_an_unencrypted_job_trains_with_its_keys_checked_and_says_so(tmp_path: Path) -> None:
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["parameterServers"]["encryption"] = False
    doc["spec"]["training"].update(maxSteps=3000, targetAccuracy=0.95)
    code, summary = run_job(doc, tmp_path)
    assert code == 0 and summary["accuracy"] >= 0.95
    logs = {log.name: log.read_text() for log in (tmp_path / "logs").glob("digits-*.log")}
    assert len(logs) == 5 and all("event=unencrypted" in text for text in logs.values())
    assert all("auth=plain" in text for name, text in logs.items() if "-ps-" in name)


@pytest.mark.heavy
def test_killed_shard_and_replica_come_back_and_the_run_completes(tmp_path: Path) -> None:
    doc = copy.deepcopy(load_example("digits-mlp.yaml"))
    doc["spec"]["training"].update(maxSteps=12000)
    doc["spec"]["parameterServers"]["checkpoint"]["everySeconds"] = 1

    def kill_a_shard_and_a_replica(run: local.LocalRun) -> None:
        wait_for_step(chief_port(run), 2500)
        time.sleep(1.5)  # let a periodic checkpoint land after step 2500
        run.shards[1].process.send_signal(signal.SIGKILL)
        run.workers[0].process.send_signal(signal.SIGKILL)

    code, summary = run_while(doc, tmp_path, kill_a_shard_and_a_replica)
    assert code == 0 and summary["phase"] == "Succeeded"
    assert summary["restartsByPod"]["digits-ps-1"] == 1
    assert summary["restartsByPod"]["digits-worker-0"] == 1
    _every_pod_reports_its_memory_and_traffic(summary, shards=2, workers=3)
    assert summary["pods"]["digits-ps-1"]["restarts"] == 1 and summary["pods"]["digits-worker-0"]["restarts"] == 1
    restored = restored_steps(tmp_path / "logs" / "digits-ps-1.log")
    assert restored and restored[0] >= 2000, "the restarted shard did not resume from its checkpoint"
    assert summary["accuracy"] >= 0.95


def test_ctrl_c_suspends_and_a_second_run_resumes_from_the_checkpoints(tmp_path: Path) -> None:
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["training"]["maxSteps"] = 6000
    code, first = suspend_at(doc, tmp_path, 1000)
    assert code == 130 and first["phase"] == "Suspended"
    code, second = run_job(doc, tmp_path)
    assert code == 0 and second["phase"] == "Succeeded"
    steps = restored_steps(tmp_path / "logs" / "digits-ps-0.log")
    assert steps and steps[0] >= 1000, "the second run started from scratch"


def test_synthetic_large_example_runs_short(tmp_path: Path) -> None:
    code, summary = run_job(load_example("synthetic-large.yaml"), tmp_path)
    assert code == 0, summary
    assert summary["globalStep"] >= 40
    with np.load(tmp_path / contract.PARAMS_FILE) as params:
        assert sum(a.size for a in params.values()) > 8_000_000


def test_a_config_error_fails_the_job_at_once_without_restarts(tmp_path: Path) -> None:
    doc = load_example("digits-mlp.yaml")
    # An npz path that does not exist: every role exits with a config error.
    doc["spec"]["data"]["source"] = f"npz:{tmp_path}/missing.npz"
    code, summary = run_job(doc, tmp_path / "out")
    assert code == 1
    assert summary["phase"] == "Failed"
    assert summary["reason"].startswith("InvalidConfig: digits-")
    assert "missing.npz" in summary["reason"]
    assert summary["restarts"] == 0


def test_a_shard_over_its_memory_limit_is_oom_killed_and_fails_the_job_as_on_a_cluster(tmp_path: Path) -> None:
    doc = load_example("digits-mlp.yaml")
    # An interpreter with numpy and ZeroMQ alone is over 40 MiB resident.
    doc["spec"]["parameterServers"]["resources"]["limits"]["memory"] = "40Mi"
    doc["spec"]["runPolicy"]["backoffLimit"] = 0
    code, summary = run_job(doc, tmp_path)
    assert code == 1 and summary["phase"] == "Failed"
    assert summary["reason"].startswith("BackoffLimitExceeded: ")
    assert re.search(r"digits-ps-\d was OOMKilled \(exit code 137\): \d+ MiB resident, over its "
                     r"resources.limits.memory 40Mi", summary["reason"]), summary["reason"]
    killed = [pod for pod in summary["pods"].values() if pod["oomKills"]]
    assert killed and all(pod["memoryLimit"] == "40Mi" and pod["peakRssBytes"] > 40 << 20 for pod in killed)
    assert all(pod["oomKills"] == 0 for name, pod in summary["pods"].items() if "worker" in name)
