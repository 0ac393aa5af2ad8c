"""The `distbelief` command as a user runs it: exit codes and one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from conftest import EXAMPLES, REPO


def distbelief(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "distbelief.operator.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_validate_accepts_every_example() -> None:
    done = distbelief("validate", *map(str, sorted(EXAMPLES.glob("*.yaml"))))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": valid") == len(list(EXAMPLES.glob("*.yaml")))


def test_validate_names_each_bad_field_on_one_line(tmp_path: Path) -> None:
    doc = yaml.safe_load((EXAMPLES / "digits-mlp.yaml").read_text())
    doc["spec"]["training"]["batchSize"] = 0
    doc["spec"]["workers"]["replikas"] = 3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    done = distbelief("validate", str(bad))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert any("spec.training.batchSize" in line and ">= 1" in line for line in lines)
    assert any("spec.workers.replikas" in line and "unknown field" in line for line in lines)


def test_run_refuses_an_invalid_job_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: distbelief.io/v1alpha1\nkind: DistBeliefJob\nmetadata: {name: Bad_Name}\n"
                   "spec: {data: {source: 'builtin:digits'}}\n")
    done = distbelief("run", str(bad), "--output", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "metadata.name" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_render_prints_the_children_as_yaml() -> None:
    done = distbelief("render", str(EXAMPLES / "digits-mlp.yaml"), "--image", "example/db:1",
                      "--operator-namespace", "ops")
    assert done.returncode == 0, done.stderr
    docs = list(yaml.safe_load_all(done.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "StatefulSet", "Deployment", "NetworkPolicy"]
    assert docs[2]["spec"]["template"]["spec"]["containers"][0]["image"] == "example/db:1"
    (operator,) = docs[4]["spec"]["ingress"][1]["from"]
    assert operator["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ops"}


def test_a_missing_config_file_is_one_clear_line(tmp_path: Path) -> None:
    done = distbelief("ps", "--config", str(tmp_path / "nope.json"), "--shard", "0")
    assert done.returncode == 2
    assert "nope.json" in done.stderr and "Traceback" not in done.stderr
