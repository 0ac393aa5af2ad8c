"""The `distbelief` command as a user runs it: exit codes and one-line errors."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import yaml

from support.cli import run_cli
from support.paths import EXAMPLES

pytestmark = pytest.mark.floors  # also run against the lowest dependency versions


def test_validate_accepts_every_example() -> None:
    done = run_cli("validate", *map(str, sorted(EXAMPLES.glob("*.yaml"))))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": valid") == len(list(EXAMPLES.glob("*.yaml")))


def test_validate_names_each_bad_field_on_one_line(tmp_path: Path) -> None:
    doc = yaml.safe_load((EXAMPLES / "digits-mlp.yaml").read_text())
    doc["spec"]["training"]["batchSize"] = 0
    doc["spec"]["workers"]["replikas"] = 3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    done = run_cli("validate", str(bad))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert any("spec.training.batchSize" in line and ">= 1" in line for line in lines)
    assert any("spec.workers.replikas" in line and "unknown field" in line for line in lines)


def test_run_refuses_an_invalid_job_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: distbelief.io/v1alpha1\nkind: DistBeliefJob\nmetadata: {name: Bad_Name}\n"
                   "spec: {data: {source: 'builtin:digits'}}\n")
    done = run_cli("run", str(bad), "--output", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "metadata.name" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_render_prints_the_children_as_yaml() -> None:
    done = run_cli("render", str(EXAMPLES / "digits-mlp.yaml"), "--image", "example/db:1",
                      "--operator-namespace", "ops")
    assert done.returncode == 0, done.stderr
    docs = list(yaml.safe_load_all(done.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "StatefulSet", "Deployment", "PodDisruptionBudget",
                                         "NetworkPolicy"]
    assert docs[2]["spec"]["template"]["spec"]["containers"][0]["image"] == "example/db:1"
    (operator,) = docs[5]["spec"]["ingress"][1]["from"]
    assert operator["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ops"}


def test_render_shows_a_worker_deployment_per_partition() -> None:
    done = run_cli("render", str(EXAMPLES / "digits-partitioned.yaml"))
    assert done.returncode == 0, done.stderr
    docs = list(yaml.safe_load_all(done.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "StatefulSet", "Deployment", "Deployment",
                                         "PodDisruptionBudget", "NetworkPolicy"]
    for partition, deployment in enumerate(docs[3:5]):
        assert deployment["metadata"]["name"] == f"digits-partitioned-worker-p{partition}"
        assert deployment["spec"]["replicas"] == 3
        env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["DISTBELIEF_PARTITION"] == str(partition)
        assert env["DISTBELIEF_STAGE_ADDRESS"] == "tcp://$(POD_IP):7172"


def test_a_missing_config_file_is_one_clear_line(tmp_path: Path) -> None:
    done = run_cli("ps", "--config", str(tmp_path / "nope.json"), "--shard", "0")
    assert done.returncode == 2
    assert "nope.json" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("address", ["metrics", "8081:", "127.0.0.1:0", "70000"])
def test_a_bad_operator_metrics_address_is_refused_by_name(address: str) -> None:
    done = run_cli("operator", "--standalone", f"--metrics={address}", timeout=60)
    assert done.returncode == 2
    assert f"argument --metrics: {address!r}: expected [HOST:]PORT" in done.stderr


def test_a_taken_operator_metrics_port_is_one_clear_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("operator", "--standalone", f"--metrics=127.0.0.1:{port}", timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"cannot serve the operator's metrics on 127.0.0.1:{port} (--metrics)" in done.stderr


def _job_file(tmp_path: Path, **spec: dict) -> Path:
    doc = yaml.safe_load((EXAMPLES / "digits-mlp.yaml").read_text())
    for key, value in spec.items():
        doc["spec"][key] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _npz(tmp_path: Path, x: np.ndarray, y: np.ndarray) -> str:
    np.savez(tmp_path / "data.npz", x=x, y=y)
    return f"npz:{tmp_path / 'data.npz'}"


@pytest.mark.parametrize("case, fragment", [
    ("nan", "x holds 1 non-finite values (NaN or infinity), the first in row 3"),
    ("label-gap", "labels {0, 1, 7} leave out 2, 3, 4, 5, 6"),
    ("entrypoint-raises", "'user_model:build_raising' raised ValueError: hidden sizes must be even"),
    ("new-gradient-shape", "'user_model:build_bad_gradient' model's loss_and_grad"),
])
def test_run_checks_data_and_model_before_any_pod_starts(tmp_path: Path, case: str, fragment: str) -> None:
    x = np.random.default_rng(0).random((40, 4)).astype(np.float32)
    y = np.arange(40) % 3
    model = {"type": "mlp", "hiddenLayers": [8]}
    if case == "nan":
        x[3, 2] = np.nan
    if case == "label-gap":
        y = np.array([0, 1, 7] * 13 + [0])
    if case.startswith(("entrypoint", "new-gradient")):
        model = {"entrypoint": "user_model:build_raising" if case == "entrypoint-raises"
                 else "user_model:build_bad_gradient"}
    job = _job_file(tmp_path, model=model, data={"source": _npz(tmp_path, x, y)})
    done = run_cli("run", str(job), "--output", str(tmp_path / "out"), "--no-progress")
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if " INFO " not in line]
    assert errors == [f"error: {errors[0][7:]}"] and fragment in errors[0], done.stderr
    assert "cannot read job config" not in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists(), "pods started, or the output folder was touched"
