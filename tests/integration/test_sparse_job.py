"""A job with embeddings: its spec, its held-out AUC, and the sparse example end to end
(local mode: real shard and replica processes), including a killed shard."""

from __future__ import annotations

import copy
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from sklearn.metrics import roc_auc_score

from distbelief.operator import errors
from distbelief.operator.local import local, report
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import scrape
from distbelief.runtime import contract
from distbelief.runtime.model import data, models

from support.examples import load_example
from support.fire import run_under_fire
from support.waiting import eventually

EXAMPLE = "ctr-sparse.yaml"


def _job(**model: Any) -> dict[str, Any]:
    doc = copy.deepcopy(load_example(EXAMPLE))
    doc["spec"]["model"].update(model)
    return doc


def test_embeddings_get_their_defaults_and_bounds() -> None:
    job = spec.validate_job(_job(embeddings={}))
    assert job["spec"]["model"]["embeddings"] == {"dim": 16, "hashBuckets": 0, "admitAfter": 1, "wide": True,
                                                  "l2": 0.001, "wideL2": 0.00003, "embedAfter": 5}
    for field, value in [("dim", 0), ("dim", 5000), ("hashBuckets", -1), ("admitAfter", 0),
                         ("expireAfterSeconds", 0)]:
        with pytest.raises(errors.SpecError, match=f"spec.model.embeddings.{field}"):
            spec.validate_job(_job(embeddings={field: value}))


def test_ids_only_data_without_embeddings_and_embeddings_under_sandblaster_are_refused() -> None:
    doc = _job()
    del doc["spec"]["model"]["embeddings"]
    with pytest.raises(errors.SpecError, match="set spec.model.embeddings"):
        spec.validate_job(doc)
    doc = _job()
    doc["spec"]["training"]["algorithm"] = "sandblaster"
    with pytest.raises(errors.SpecError, match="spec.model.embeddings: needs spec.training.algorithm: downpour"):
        spec.validate_job(doc)
    doc = _job()
    doc["spec"]["data"]["source"] = "synthetic-ctr:fields=2,ids=10,samples=100,zipf=0.1"
    with pytest.raises(errors.SpecError, match="zipf must be within"):
        spec.validate_job(doc)


def test_auc_is_the_rank_statistic_with_ties_shared() -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 500)
    scores = np.round(labels * 0.5 + rng.standard_normal(500), 1)  # many ties
    assert models.auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert models.auc(np.arange(4.0), np.array([0, 0, 1, 1])) == 1.0
    assert models.auc(np.ones(4), np.array([0, 1, 0, 1])) == 0.5
    assert models.auc(np.arange(3.0), np.zeros(3, dtype=int)) is None


def _run(doc: dict[str, Any], output: Path) -> tuple[int, dict[str, Any]]:
    code = local.LocalRun(DistBeliefJob.validated(doc), str(output)).run(progress=False)
    return code, json.loads((output / report.REPORT_FILE).read_text())


@pytest.mark.slow
def test_the_sparse_example_trains_and_beats_trivial_baselines_on_auc(tmp_path: Path) -> None:
    doc = load_example(EXAMPLE)
    code, summary = _run(doc, tmp_path)
    assert code == 0 and summary["phase"] == "Succeeded"
    # Chance is 0.5; the planted model's ids carry real signal, and the example learns it.
    assert summary["auc"] >= 0.72
    _, y, _ = data.read_source(doc["spec"]["data"]["source"])
    assert summary["accuracy"] > max(y.mean(), 1 - y.mean()) + 0.05  # beats the majority class
    chief = tmp_path / "volumes" / "ctr-sparse-ps-0" / "checkpoints"
    history = [json.loads(line) for line in (chief / contract.HISTORY_FILE).read_text().splitlines()]
    assert all(0 <= row["auc"] <= 1 for row in history)
    assert json.loads((chief / contract.RESULT_FILE).read_text())["auc"] == summary["auc"]
    assert summary["globalStep"] >= doc["spec"]["training"]["maxSteps"]


@pytest.mark.heavy
@pytest.mark.slow
def test_a_killed_shard_comes_back_with_its_rows_and_the_sparse_job_completes(tmp_path: Path) -> None:
    doc = load_example(EXAMPLE)
    doc["spec"]["training"]["maxSteps"] = 3000
    doc["spec"]["parameterServers"]["checkpoint"]["everySeconds"] = 1

    def kill_shard_1(run: local.LocalRun, _: threading.Thread) -> list:
        port = run.shards[0].ports[contract.METRICS_PORT_NAME]
        eventually(lambda: (scrape.read(f"http://127.0.0.1:{port}/metrics").global_step or 0) >= 400, 120,
                   interval=0.2, what="step 400")
        time.sleep(1.5)  # a periodic checkpoint lands
        run.shards[1].process.send_signal(signal.SIGKILL)
        return []

    _, codes, _ = run_under_fire(doc, tmp_path, kill_shard_1)
    summary = json.loads((tmp_path / report.REPORT_FILE).read_text())
    assert codes == [0] and summary["phase"] == "Succeeded"
    assert summary["restartsByPod"]["ctr-sparse-ps-1"] == 1
    log = (tmp_path / "logs" / "ctr-sparse-ps-1.log").read_text()
    restored = [int(line.split("rows=")[1].split()[0]) for line in log.splitlines() if "event=rows_restored" in line]
    assert restored and restored[0] > 1000, "the restarted shard lost its embedding rows"
    assert summary["auc"] >= 0.65


@pytest.mark.slow
def test_a_second_run_of_the_sparse_job_into_its_folder_resumes_from_its_checkpoints(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Local mode's checks derive the layout the shards' checkpoints carry (embeddings
    included), so the folder of a suspended run is taken up, not refused as another model's."""
    doc = load_example(EXAMPLE)
    doc["spec"]["data"]["source"] = "synthetic-ctr:fields=4,ids=500,samples=4000,zipf=1.1,seed=1"
    doc["spec"]["training"]["maxSteps"] = 1_000_000
    doc["spec"]["parameterServers"]["checkpoint"]["everySeconds"] = 1
    doc["spec"]["workers"]["replicas"] = 1
    output = tmp_path / "out"
    run = local.LocalRun(DistBeliefJob.validated(doc), str(output))
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run.run(progress=False)))
    thread.start()
    port = run.shards[0].ports[contract.METRICS_PORT_NAME]
    eventually(lambda: (scrape.read(f"http://127.0.0.1:{port}/metrics").checkpoint_step or 0) >= 100, 120,
               interval=0.2, what="a checkpoint past step 100")
    run.interrupt()
    thread.join(timeout=60)
    first = json.loads((output / report.REPORT_FILE).read_text())
    assert codes == [130] and first["phase"] == "Suspended"
    doc["spec"]["training"]["maxSteps"] = first["globalStep"] + 100
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    assert local.run_file(str(path), output=str(output), progress=False) == 0
    assert "resuming from step" in capsys.readouterr().out
    assert json.loads((output / report.REPORT_FILE).read_text())["phase"] == "Succeeded"
