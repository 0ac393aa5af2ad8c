"""examples/usercode/: the ready-to-copy user model and its job, run as docs/guides/your-model.md says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from distbelief.operator.validation import spec
from distbelief.runtime.model.job import Job

from support.cli import run_cli
from support.paths import REPO

USERCODE = REPO / "examples" / "usercode"
JOB = USERCODE / "job.yaml"


def test_the_user_model_follows_the_interface_and_its_gradient_is_right(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(USERCODE))
    (doc,) = spec.load_manifests(str(JOB))
    job = spec.validate_job(doc)
    derived = Job(spec.job_config(job))
    dataset, model = derived.dataset, derived.model
    params = model.init_params(3)
    batch = (dataset.x_train[:16], dataset.y_train[:16])
    out = np.zeros_like(params)
    loss, grad = model.loss_and_grad(params, batch, out)
    assert grad is out
    rng = np.random.default_rng(0)
    for index in rng.choice(len(params), 5, replace=False):  # central differences, in float64
        step = np.zeros_like(params, dtype=np.float64)
        step[index] = 1e-3
        up = model.loss_and_grad((params + step).astype(np.float32), batch)[0]
        down = model.loss_and_grad((params - step).astype(np.float32), batch)[0]
        assert grad[index] == pytest.approx((up - down) / 2e-3, abs=2e-3)


@pytest.mark.slow
def test_the_example_job_trains_locally_and_predict_scores_it(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(USERCODE)}
    output = tmp_path / "out"
    done = run_cli("run", str(JOB), "--output", str(output), "--no-progress", env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads((output / "report.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["accuracy"] >= 0.93
    scored = run_cli("predict", str(JOB), "--output", str(output), env=env, timeout=120)
    assert scored.returncode == 0, scored.stderr
    assert scored.stdout.startswith(f"held-out accuracy {summary['accuracy']:.4f}")
