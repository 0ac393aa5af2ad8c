"""The output folder of `distbelief run`: one run at a time, resume announced, a finished
job or a changed model noticed before any pod starts, and only this run's figures."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from distbelief.operator.local import outputdir, preflight, report
from distbelief.operator.local.localpods import volume_dir
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract, errors
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.wire.layout import Layout

from support.cli import run_cli
from support.examples import load_example
from support.paths import EXAMPLES


def _errors(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if " INFO " not in line]


def _chief_dir(output: Path, shard: int = 0) -> Path:
    return Path(volume_dir(str(output), f"digits-ps-{shard}", contract.CHECKPOINT_VOLUME))


def _save_checkpoints(output: Path, layout: Layout, step: int) -> None:
    for shard in range(layout.shards):
        folder = _chief_dir(output, shard)
        folder.mkdir(parents=True, exist_ok=True)
        ckpt = checkpoint.Checkpoint(step=step, layout=layout.hash, shard=shard,
                                     arrays={"params": np.zeros(layout.size(shard), dtype=np.float32)})
        checkpoint.save(str(folder), ckpt, keep=3)


def _job_layout(doc: dict) -> Layout:
    job = DistBeliefJob.validated(doc)
    return Layout.of(preflight.check(job).shapes, job.config.spec.parameter_servers.shards)


def test_a_second_run_into_a_folder_in_use_is_refused_in_one_line(tmp_path: Path) -> None:
    output = tmp_path / "out"
    with outputdir.locked(str(output)):
        done = run_cli("run", str(EXAMPLES / "digits-mlp.yaml"), "--output", str(output), "--no-progress")
    assert done.returncode == 1
    assert _errors(done) == [f"error: {output} is in use by another distbelief run (pid {os.getpid()}): wait "
                             "for it to end, or give this run another --output DIR"]
    assert not (output / "logs").exists()


def test_a_finished_job_is_not_trained_again_without_fresh(tmp_path: Path) -> None:
    output = tmp_path / "out"
    _chief_dir(output).mkdir(parents=True)
    (_chief_dir(output) / contract.RESULT_FILE).write_text(json.dumps(
        {"phase": "Succeeded", "reason": "MaxStepsReached", "globalStep": 8000, "finishedAt": time.time()}))
    done = run_cli("run", str(EXAMPLES / "digits-mlp.yaml"), "--output", str(output), "--no-progress")
    assert done.returncode == 0
    assert done.stdout.splitlines() == ["already Succeeded at step 8000; --fresh to train again"]
    assert not (output / "logs").exists()


def test_a_changed_model_is_refused_before_any_pod_starts(tmp_path: Path) -> None:
    output = tmp_path / "out"
    doc = load_example("digits-mlp.yaml")
    _save_checkpoints(output, _job_layout(doc), step=1200)
    doc["spec"]["model"]["hiddenLayers"] = [32]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    done = run_cli("run", str(job), "--output", str(output), "--no-progress")
    assert done.returncode == 2
    (line,) = _errors(done)
    assert line.startswith(f"error: {_chief_dir(output)}: the checkpoints there are of another model or shard count")
    assert "--fresh" in line
    assert not (output / "logs").exists()


def test_a_changed_shard_count_is_refused_too(tmp_path: Path) -> None:
    output = tmp_path / "out"
    doc = load_example("digits-mlp.yaml")
    _save_checkpoints(output, _job_layout(doc), step=1200)
    doc["spec"]["parameterServers"]["shards"] = 3
    config = spec.job_config(spec.validate_job(doc))
    with pytest.raises(errors.ConfigError, match="another model or shard count"):
        outputdir.earlier(str(output), config, _job_layout(doc).hash)


def test_a_run_to_resume_is_announced_with_its_step_and_time(tmp_path: Path) -> None:
    output = tmp_path / "out"
    doc = load_example("digits-mlp.yaml")
    layout = _job_layout(doc)
    _save_checkpoints(output, layout, step=1200)
    config = spec.job_config(spec.validate_job(doc))
    found = outputdir.earlier(str(output), config, layout.hash)
    assert found.step == 1200 and found.result is None
    assert found.announcement().startswith("resuming from step 1200 (checkpoints of 20")
    assert outputdir.earlier(str(tmp_path / "empty"), config, layout.hash).announcement() is None


def test_fresh_clears_the_folder_but_keeps_the_lock(tmp_path: Path) -> None:
    output = tmp_path / "out"
    with outputdir.locked(str(output)):
        (output / "logs").mkdir()
        (output / "report.json").write_text("{}")
        outputdir.clear(str(output))
        assert os.listdir(output) == [outputdir.LOCK_FILE]


def test_the_summary_never_shows_an_earlier_runs_figures(tmp_path: Path) -> None:
    chief = tmp_path / "chief"
    chief.mkdir()
    before = time.time() - 100
    (chief / contract.HISTORY_FILE).write_text(json.dumps(
        {"time": before, "elapsed": 5, "step": 900, "loss": 0.2, "accuracy": 0.93, "examplesPerSecond": 10.0}) + "\n")
    (chief / contract.RESULT_FILE).write_text(json.dumps(
        {"phase": "Failed", "reason": "DeadlineExceeded", "globalStep": 900, "accuracy": 0.93, "finishedAt": before}))
    summary = report.write(str(tmp_path), str(chief), job="digits", phase="Failed", reason="InvalidConfig: x",
                           started=time.time(), pods={})
    assert summary["accuracy"] is None and summary["loss"] is None and summary["evaluations"] == 0
    assert summary["globalStep"] == 0
