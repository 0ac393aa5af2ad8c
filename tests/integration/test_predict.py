"""`distbelief predict` and the snippet of docs/guides/local-mode.md: the trained parameters of a run, used with
training's preprocessing (the built-in digits are scaled to 0..1)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distbelief.operator import predict
from distbelief.operator.validation import spec
from distbelief.runtime import contract
from distbelief.runtime.model import data, models
from distbelief.runtime.model.job import Job

from support.cli import run_cli
from support.examples import load_example
from support.paths import EXAMPLES, REPO

JOB = EXAMPLES / "digits-mlp.yaml"


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """An output folder with the params.npz of a model trained here, in-process (plain SGD)."""
    job = spec.validate_job(load_example("digits-mlp.yaml"))
    derived = Job(spec.job_config(job))
    dataset, model = derived.dataset, derived.model
    params = model.init_params(0)
    batches = data.minibatches(dataset, 32, np.random.default_rng(0))
    for _ in range(1500):
        _, grad = model.loss_and_grad(params, next(batches))
        params -= np.float32(0.2) * grad
    output = tmp_path_factory.mktemp("run")
    np.savez(output / contract.PARAMS_FILE, **models.split_params(model, params))
    return output, params


def test_predict_prints_the_held_out_accuracy_and_loss_the_chief_would(run_folder) -> None:
    output, params = run_folder
    trained = predict.load(str(JOB), output=str(output))
    np.testing.assert_array_equal(trained.params, params)
    loss, accuracy = models.evaluate(trained.model, params, trained.dataset.x_test, trained.dataset.y_test)
    assert accuracy > 0.9
    done = run_cli("predict", str(JOB), "--output", str(output))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"held-out accuracy {accuracy:.4f}  loss {loss:.4f}  (359 examples)"


def test_predictions_for_raw_digits_get_trainings_scaling(run_folder, tmp_path: Path) -> None:
    output, params = run_folder
    raw_x, y = data._builtin("digits")  # pixel intensities 0..16, as a user's own 8x8 images
    np.savez(tmp_path / "mine.npz", x=raw_x[:200])
    done = run_cli("predict", str(JOB), "--output", str(output), "--data", f"npz:{tmp_path}/mine.npz",
                   "--out", str(tmp_path / "labels.txt"))
    assert done.returncode == 0, done.stderr
    labels = np.loadtxt(tmp_path / "labels.txt", dtype=np.int64)
    trained = predict.load(str(JOB), output=str(output))
    np.testing.assert_array_equal(labels, trained.model.predict(params, raw_x[:200] / 16.0))
    assert np.mean(labels == y[:200]) > 0.9  # unscaled pixels would score far worse


def test_predict_with_labels_reports_their_accuracy(run_folder, tmp_path: Path) -> None:
    output, _ = run_folder
    raw_x, y = data._builtin("digits")
    np.savez(tmp_path / "labelled.npz", x=raw_x, y=y)
    done = run_cli("predict", str(JOB), "--output", str(output), "--data", f"npz:{tmp_path}/labelled.npz",
                      "--out", str(tmp_path / "labels.npz"))
    assert done.returncode == 0, done.stderr
    accuracy = float(re.search(r"accuracy (\d\.\d+)", done.stdout).group(1))
    assert accuracy > 0.9
    with np.load(tmp_path / "labels.npz") as saved:
        assert saved["y"].shape == y.shape


def test_predict_reads_a_parquet_glob_by_column(run_folder, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    output, params = run_folder
    raw_x, y = data._builtin("digits")
    for k, rows in enumerate((slice(0, 900), slice(900, None))):
        columns = {f"p{i}": raw_x[rows, i] for i in range(64)}
        pq.write_table(pa.table({**columns, "y": y[rows]}), tmp_path / f"digits-{k}.parquet", row_group_size=300)
    done = run_cli("predict", str(JOB), "--output", str(output), "--data", f"parquet:{tmp_path}/digits-*.parquet",
                   "--out", str(tmp_path / "labels.npz"))
    assert done.returncode == 0, done.stderr
    trained = predict.load(str(JOB), output=str(output))
    with np.load(tmp_path / "labels.npz") as saved:
        np.testing.assert_array_equal(saved["y"], trained.model.predict(params, raw_x / 16.0))  # scaled as trained
    assert float(re.search(r"accuracy (\d\.\d+)", done.stdout).group(1)) > 0.9


def test_predict_without_a_finished_run_says_what_to_do(tmp_path: Path) -> None:
    done = run_cli("predict", str(JOB), "--output", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: {tmp_path}: no params.npz; a run writes it when the job finishes "
                                   "(distbelief run JOB.yaml, or --output DIR for another folder)")


def test_the_guides_snippet_runs(run_folder, tmp_path: Path) -> None:
    output, params = run_folder
    guide = (REPO / "docs" / "guides" / "local-mode.md").read_text()
    snippet = re.search(r"```python\n# predict.*?\n(.*?)```", guide, re.S).group(1)
    assert len(snippet.strip().splitlines()) == 5
    raw_x, y = data._builtin("digits")
    np.savez(tmp_path / "my-digits.npz", x=raw_x[:20])
    code = snippet.replace("out/digits", str(output)).replace("examples/", f"{EXAMPLES}/")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().split("\n", 1)
    assert first.startswith("(") and float(first.strip("()").split(",")[1]) > 0.9
    trained = predict.load(str(JOB), output=str(output))
    assert second == str(trained.model.predict(params, raw_x[:20] / 16.0))
