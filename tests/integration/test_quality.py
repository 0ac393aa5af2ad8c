"""A collapse is never a quiet success: the chief's held-out record and its verdict, the
status conditions it becomes (ModelDegraded, RowBudgetReached), and what the report and
summary say."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import prometheus_client as prom
import pytest
import yaml

from distbelief.operator import predict
from distbelief.operator.local import local, report
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import scrape
from distbelief.operator.status.status import Observed, compute_status
from distbelief.runtime import contract, errors
from distbelief.runtime.algorithms.quality import HeldOutRecord, chance_level, degradation
from distbelief.runtime.observe.metrics import ChiefMetrics, ShardMetrics

from support.examples import load_example

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)


def _record(evaluations: list[tuple[int, float, float]], *, two_classes: bool = True, chance: float = 0.5
            ) -> HeldOutRecord:
    """A record of (step, loss, metric) evaluations: the metric is AUC, or accuracy."""
    record = HeldOutRecord(two_classes=two_classes, chance=chance)
    for step, loss, metric in evaluations:
        record.observe(step, loss, 0.5 if two_classes else metric, metric if two_classes else None)
    return record


def test_a_model_that_keeps_its_best_is_not_degraded() -> None:
    record = _record([(0, 0.69, 0.5), (1000, 0.58, 0.77), (2000, 0.56, 0.785), (3000, 0.56, 0.78)])
    assert degradation(record.as_dict()) is None
    assert (record.best, record.best_step, record.last) == (0.785, 2000, 0.78)


def test_a_model_that_ends_at_chance_is_degraded_whatever_its_loss() -> None:
    # A collapse as seen at learning rate 1.0, AUC 0.500 at the end, the loss unremarkable.
    record = _record([(0, 0.69, 0.5), (500, 0.60, 0.74), (6000, 0.698, 0.5003)])
    reason, message = degradation(record.as_dict())
    assert reason == "HeldOutAtChance"
    assert message == "held-out AUC ended at 0.5003, chance level (0.5000); its best was 0.7400 at step 500"


def test_a_model_far_below_its_own_best_is_degraded() -> None:
    # An overfitting run: best 0.779 near one epoch, 0.69 at the end.
    record = _record([(1000, 0.56, 0.779), (3000, 1.18, 0.704), (6000, 1.89, 0.6913)])
    reason, message = degradation(record.as_dict())
    assert reason == "HeldOutFellFromBest"
    assert "ended at 0.6913 (step 6000), 0.0877 below its best 0.7790 at step 1000" in message
    assert degradation(_record([(1000, 0.56, 0.779), (6000, 0.6, 0.75)]).as_dict()) is None  # 0.029: noise


@pytest.mark.parametrize("late_loss, reason", [(float("nan"), "HeldOutLossDiverged"), (9.0, "HeldOutLossDiverged"),
                                               (0.6, None)])
def test_a_held_out_loss_that_jumps_is_named_with_its_step(late_loss: float, reason: str | None) -> None:
    record = _record([(100, 0.9, 0.7), (400, 0.5, 0.8), (700, 7.5, 0.79), (900, late_loss, 0.79)])
    assert record.diverged == {"step": 700, "from": 0.5, "to": 7.5}  # the first: 15x the lowest before it
    verdict = degradation(record.as_dict())
    if reason is None:
        assert verdict is None  # it came back
        return
    assert verdict[0] == reason
    assert verdict[1].startswith("held-out loss went from 0.5 to 7.5 at step 700; at step 900 it is ")


def test_a_non_finite_loss_is_named_too() -> None:
    record = _record([(100, 0.5, 0.8), (200, math.inf, 0.5)])
    assert record.diverged == {"step": 200, "from": 0.5, "to": None}
    reason, message = degradation(record.as_dict())
    assert reason == "HeldOutLossDiverged" and "to a non-finite value at step 200" in message


def test_accuracy_is_judged_against_the_majority_class() -> None:
    y = np.array([0] * 70 + [1] * 20 + [2] * 10)
    assert chance_level(y, two_classes=False) == 0.7
    assert chance_level(y[:2], two_classes=True) == 0.5
    record = _record([(10, 1.0, 0.9), (20, 1.1, 0.71)], two_classes=False, chance=0.7)
    reason, message = degradation(record.as_dict())
    assert reason == "HeldOutAtChance" and message.startswith("held-out accuracy ended at 0.7100, chance level (0.7000)")


def test_a_restarted_chief_replays_the_history_it_wrote(tmp_path: Path) -> None:
    history = tmp_path / contract.HISTORY_FILE
    lines = [{"step": 100, "loss": 0.6, "accuracy": 0.7, "auc": 0.8}, {"step": 200, "loss": 0.7, "accuracy": 0.6,
                                                                      "auc": 0.7}, {"not": "an evaluation"}]
    history.write_text("".join(json.dumps(line) + "\n" for line in lines))
    record = HeldOutRecord(two_classes=True, chance=0.5)
    record.replay(str(history))
    assert (record.best, record.best_step, record.last, record.last_step) == (0.8, 100, 0.7, 200)
    HeldOutRecord(two_classes=True, chance=0.5).replay(str(tmp_path / "none.jsonl"))  # no history: nothing


# -- the status, the report ------------------------------------------------------------------


def _job(**status: Any) -> DistBeliefJob:
    doc = spec.validate_job(load_example("ctr-sparse.yaml"))
    doc["status"] = status
    return DistBeliefJob.of(doc)


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status["conditions"] if c["type"] == kind), None)


def test_the_chiefs_verdict_becomes_the_condition_model_degraded_and_stays() -> None:
    registry = prom.CollectorRegistry()
    ShardMetrics(registry, 0).global_step.set(6000)
    chief = ChiefMetrics(registry)
    chief.finished.labels(reason="MaxStepsReached", outcome="Succeeded").set(1)
    chief.degraded.labels(reason="HeldOutAtChance", message="held-out AUC ended at 0.5000, chance level").set(1)
    figures = scrape.parse(prom.generate_latest(registry).decode())
    assert (figures.degraded_reason, figures.degraded_message) == ("HeldOutAtChance",
                                                                    "held-out AUC ended at 0.5000, chance level")
    status = compute_status(_job(), Observed(shards_ready=2, workers_ready=2, figures=figures), NOW)
    assert status["phase"] == "Succeeded" and _condition(status, "Succeeded")["reason"] == "MaxStepsReached"
    degraded = _condition(status, "ModelDegraded")
    assert degraded["status"] == "True" and degraded["reason"] == "HeldOutAtChance"
    assert degraded["message"] == "held-out AUC ended at 0.5000, chance level"
    gone = compute_status(_job(**status), Observed(), NOW + datetime.timedelta(minutes=5))  # the pods stopped
    assert _condition(gone, "ModelDegraded") == degraded


def test_refused_or_evicted_rows_become_the_condition_row_budget_reached() -> None:
    registry = prom.CollectorRegistry()
    ShardMetrics(registry, 0).global_step.set(10)
    chief = ChiefMetrics(registry)
    for figure, value in {"max": 1024, "budget": 1024, "refused": 1976, "evicted": 0}.items():
        chief.rows.labels(figure=figure).set(value)
    figures = scrape.parse(prom.generate_latest(registry).decode())
    assert (figures.rows_max, figures.row_budget, figures.rows_refused, figures.rows_evicted) == (1024, 1024, 1976, 0)
    status = compute_status(_job(), Observed(shards_ready=2, workers_ready=2, figures=figures), NOW)
    budget = _condition(status, "RowBudgetReached")
    assert budget["status"] == "True" and budget["reason"] == "RowsRefused"
    assert budget["message"].startswith("a shard reached its row budget of 1,024 rows "
                                        "(spec.model.embeddings.maxRowsPerShard): 1,976 new rows refused")
    quiet = scrape.Figures(global_step=10, rows_max=10, row_budget=1024, rows_refused=0, rows_evicted=0)
    assert _condition(compute_status(_job(), Observed(figures=quiet), NOW), "RowBudgetReached") is None


def test_the_report_and_the_summary_say_the_model_degraded(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    chief = tmp_path / "chief"
    chief.mkdir()
    record = _record([(100, 0.6, 0.74), (500, 0.9, 0.69)]).as_dict()
    verdict = degradation(record)
    result = {"phase": "Succeeded", "reason": "MaxStepsReached", "globalStep": 500, "loss": 0.9, "accuracy": 0.6,
              "auc": 0.69, "examplesPerSecond": 10.0, "finishedAt": 2e9, "heldOut": record,
              "degraded": {"reason": verdict[0], "message": verdict[1]}}
    (chief / contract.RESULT_FILE).write_text(json.dumps(result))
    conditions = [{"type": "Succeeded", "status": "True", "reason": "MaxStepsReached"},
                  {"type": "ModelDegraded", "status": "True", "reason": verdict[0], "message": verdict[1]}]
    summary = report.write(str(tmp_path), str(chief), job="ctr", phase="Succeeded", reason="MaxStepsReached",
                           started=0.0, pods={}, conditions=conditions)
    saved = json.loads((tmp_path / report.REPORT_FILE).read_text())
    assert saved["degraded"] == result["degraded"] and saved["heldOut"]["best"] == 0.74
    assert saved["warnings"] == [{"type": "ModelDegraded", "reason": "HeldOutFellFromBest", "message": verdict[1]}]
    report.print_summary(summary, str(tmp_path))
    out = capsys.readouterr().out
    assert "ctr: Succeeded (MaxStepsReached)" in out
    assert f"MODEL DEGRADED     {verdict[1]}" in out


# -- end to end, in local mode ----------------------------------------------------------------


def _collapsing_digits(**training: Any) -> dict[str, Any]:
    """The digits example with plain SGD at a rate that sends it to chance within a second
    (its best evaluation may be the first)."""
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["training"].update({"optimizer": "sgd", "learningRate": 2.0, "maxSteps": 600, **training})
    return doc


def _run(doc: dict[str, Any], output: Path) -> tuple[int, dict[str, Any]]:
    code = local.LocalRun(DistBeliefJob.validated(doc), str(output)).run(progress=False)
    return code, json.loads((output / report.REPORT_FILE).read_text())


@pytest.mark.slow
def test_a_collapsed_job_succeeds_with_model_degraded_and_keeps_its_best(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    doc = _collapsing_digits(keepBest=True)
    code, summary = _run(doc, tmp_path)
    assert code == 0 and summary["phase"] == "Succeeded" and summary["reason"] == "MaxStepsReached"
    assert summary["degraded"]["reason"] in ("HeldOutAtChance", "HeldOutFellFromBest")
    assert [w["type"] for w in summary["warnings"]] == ["ModelDegraded"]
    assert "MODEL DEGRADED" in capsys.readouterr().out
    best = summary["best"]
    assert best["params"] == contract.BEST_PARAMS_FILE and (tmp_path / contract.BEST_PARAMS_FILE).exists()
    assert best["accuracy"] == summary["heldOut"]["best"] >= summary["accuracy"]
    # predict --best scores the best evaluation's parameters, not the final ones.
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert predict.load(str(path), output=str(tmp_path), best=True).evaluate()[1] == pytest.approx(best["accuracy"])
    assert predict.load(str(path), output=str(tmp_path)).evaluate()[1] == pytest.approx(summary["accuracy"])


@pytest.mark.slow
def test_fail_on_degraded_fails_the_job_with_reason_model_degraded(tmp_path: Path) -> None:
    code, summary = _run(_collapsing_digits(failOnDegraded=True), tmp_path)
    assert code == 1 and summary["phase"] == "Failed" and summary["reason"] == "ModelDegraded"
    result = json.loads((tmp_path / "volumes" / "digits-ps-0" / "checkpoints" / contract.RESULT_FILE).read_text())
    assert result["phase"] == "Failed" and result["degraded"]["reason"] == summary["degraded"]["reason"]


def test_predict_best_without_keep_best_says_how_to_get_it(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(load_example("digits-mlp.yaml")))
    with pytest.raises(errors.ConfigError, match="params-best.npz; a run saves it with spec.training.keepBest: true"):
        predict.load(str(path), output=str(tmp_path), best=True)
