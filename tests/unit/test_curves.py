"""Training curves: the figures local mode records, the plot, and the bar before the first
evaluation."""

from __future__ import annotations

import json
import time
from pathlib import Path

import prometheus_client as prom

from distbelief.operator.local import curves, report
from distbelief.operator.status import scrape
from distbelief.runtime.observe.metrics import ChiefMetrics, ShardMetrics


def test_shard_0s_training_loss_is_read_from_its_metrics() -> None:
    registry = prom.CollectorRegistry()
    shard = ShardMetrics(registry, 0)
    ChiefMetrics(registry)
    shard.global_step.set(40)
    shard.train_loss.set(0.75)
    figures = scrape.parse(prom.generate_latest(registry).decode())
    assert figures.train_loss == 0.75


def test_the_recorder_writes_a_start_line_and_rates_per_replica(tmp_path: Path, monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(curves.time, "time", lambda: clock[0])
    recorder = curves.Recorder(str(tmp_path), resumed_at=1200)
    shard = scrape.Figures(global_step=1300, train_loss=0.5, examples_per_second=3000.0)
    replicas = {f"digits-worker-{i}": scrape.Figures(replica_examples=100 * i) for i in range(3)}
    recorder.record(shard, replicas)
    clock[0] += 0.5
    recorder.record(shard, replicas)  # too soon: not recorded
    recorder.record(scrape.Figures(), replicas)  # the chief did not answer
    clock[0] += 5
    recorder.record(scrape.Figures(global_step=1300, train_loss=0.0), replicas)  # no push applied yet: unset
    clock[0] -= 5
    clock[0] += 1.5
    recorder.record(shard, {name: scrape.Figures(replica_examples=seen.replica_examples + 400 * i)
                            for i, (name, seen) in enumerate(replicas.items())})
    start, first, second = curves.read(str(tmp_path))
    assert start == {"time": 1000.0, "event": "start", "step": 1200}
    assert (first["step"], first["trainLoss"], first["replicas"], first["examplesPerSecondPerReplica"]) == \
        (1300, 0.5, 3, 1000.0)
    assert first["replicaExamplesPerSecond"] == {}  # a rate needs two readings
    assert second["replicaExamplesPerSecond"] == {"digits-worker-0": 0.0, "digits-worker-1": 200.0,
                                                  "digits-worker-2": 400.0}


def test_the_plot_shows_training_and_held_out_loss_accuracy_and_rates_over_steps_with_resumes() -> None:
    now = time.time()
    history = [{"time": now, "step": s, "loss": 1.0 / (s + 1), "accuracy": s / 4000} for s in (0, 1000, 2000, 3000)]
    def row(step: int) -> dict:
        return {"step": step, "trainLoss": 0.9 / (step + 1), "examplesPerSecond": 900.0,
                "examplesPerSecondPerReplica": 300.0, "replicaExamplesPerSecond": {"w-0": 250.0, "w-1": 350.0}}

    rows = [{"event": "start", "step": 0}, row(500), row(1500), {"event": "start", "step": 1800}, row(2500)]
    fig = curves.figure(history, rows, title="digits: Succeeded")
    loss, accuracy, rate = fig.axes
    assert [line.get_label() for line in loss.lines if not line.get_label().startswith("_")] == \
        ["held-out", "training (moving average)"]
    assert loss.get_xlabel() == accuracy.get_xlabel() == rate.get_xlabel() == "global step"
    assert list(loss.lines[0].get_xdata()) == [0, 1000, 2000, 3000]
    # Each run's training line on its own: none drawn across the resume.
    assert [list(line.get_xdata()) for line in loss.lines[1:] if line.get_linestyle() != "--"] == [[500, 1500], [2500]]
    assert list(rate.lines[1].get_ydata()) == [300.0] * 2
    assert [list(line.get_ydata()) for line in rate.lines[2:4]] == [[250.0] * 2, [350.0] * 2]  # each replica
    for ax in (loss, accuracy, rate):  # one dashed marker, at the resume (not at the first start)
        assert [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "--"] == [1800]
    assert "resumed at step 1800" in fig._suptitle.get_text()


def test_the_bar_says_it_waits_for_the_first_evaluation() -> None:
    figures = scrape.Figures(global_step=10, loss=0.0, accuracy=0.0, examples_per_second=1234.0)
    assert report.postfix(figures, evaluated=False) == "waiting for the first evaluation ex/s=1,234"
    assert report.postfix(figures, evaluated=True) == "loss=0.0000 acc=0.0000 ex/s=1,234"


def test_the_report_plot_is_drawn_from_history_and_curves(tmp_path: Path) -> None:
    chief = tmp_path / "chief"
    chief.mkdir()
    started = time.time()
    (chief / "history.jsonl").write_text(json.dumps(
        {"time": started + 1, "elapsed": 1, "step": 100, "loss": 0.5, "accuracy": 0.8, "examplesPerSecond": 9.0}) + "\n")
    curves.Recorder(str(tmp_path), resumed_at=0).record(
        scrape.Figures(global_step=50, train_loss=0.7, examples_per_second=10.0), {"w-0": scrape.Figures()})
    summary = report.write(str(tmp_path), str(chief), job="digits", phase="Suspended", reason="Interrupted",
                           started=started, pods={})
    assert summary["plot"] == report.PLOT_FILE
    assert (tmp_path / report.PLOT_FILE).read_bytes().startswith(b"\x89PNG")
