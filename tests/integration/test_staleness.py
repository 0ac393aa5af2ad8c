"""Bounded staleness (spec.training.maxStaleness): a push computed from parameters more
than tau updates old is not applied, and the replica computes again from fresh ones."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import prometheus_client as prom
import pytest

from distbelief.operator.local import local
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import scrape
from distbelief.runtime import jobspec
from distbelief.runtime.algorithms.downpour.worker import Worker
from distbelief.runtime.model import data, models
from distbelief.runtime.observe.metrics import ShardMetrics, WorkerMetrics
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.wire.layout import Layout

from support.examples import load_example
from support.shards import start_shards


def test_a_push_staler_than_the_bound_is_not_applied_and_brings_fresh_parameters(tmp_path: Path) -> None:
    layout = Layout.of([("w", (4, 3))], shards=1)
    live = start_shards(tmp_path, layout, np.zeros(layout.total, np.float32), optimizer="sgd", learning_rate=0.1)
    live.shards[0].plugin(DenseSlice).max_staleness = 1
    group, ones = live.group(), np.ones(layout.total, np.float32)
    dense = Float32Dense(group)
    try:
        assert [r.step for r in dense.push(ones, steps=[0], examples=1, loss=1.0)] == [1]  # 0 behind
        assert [r.step for r in dense.push(ones, steps=[0], examples=1, loss=1.0)] == [2]  # 1 behind: in bound
        held = live.params(0).copy()
        out = np.empty(layout.total, np.float32)
        [reply] = dense.push_and_pull(ones, out, steps=[0], examples=1, loss=1.0)  # 2 behind
        assert reply.stale and reply.step == 2
        np.testing.assert_array_equal(live.params(0), held)  # not applied...
        np.testing.assert_array_equal(out, held)             # ...and the fresh slice came back
        metrics = live.shards[0].metrics
        assert metrics.stale._value.get() == 1 and metrics.staleness_max._value.get() == 1
    finally:
        group.close()
        live.stop()


def test_with_a_bound_of_zero_two_replicas_only_ever_apply_fresh_gradients(tmp_path: Path) -> None:
    dataset = data.load(jobspec.Data(source="builtin:digits", test_fraction=0.2, seed=0))
    model = models.build_model(jobspec.Model(type="softmax"), dataset.n_features, dataset.n_classes)
    layout = Layout.of(model.shapes, shards=2)
    live = start_shards(tmp_path, layout, model.init_params(0), optimizer="adagrad", learning_rate=0.1)
    for shard in live.shards:
        shard.plugin(DenseSlice).max_staleness = 0
    stop = threading.Event()
    workers = [Worker(jobspec.Training(batch_size=16), live.group(), model, dataset,
                      WorkerMetrics(prom.CollectorRegistry()), seed=seed, stop=stop) for seed in (1, 2)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    try:
        for thread in threads:
            thread.start()
        while min(s.step for s in live.shards) < 300 and all(t.is_alive() for t in threads):
            stop.wait(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        live.stop()
    assert min(s.step for s in live.shards) >= 300
    assert all(s.metrics.staleness_max._value.get() == 0 for s in live.shards)  # every applied one was fresh
    assert sum(s.metrics.stale._value.get() for s in live.shards) > 0  # the two did collide, and were held back
    assert all(w.steps > 50 for w in workers)  # neither starved


def test_an_overlapped_replica_applies_every_gradient_one_step_staler_and_learns(tmp_path: Path) -> None:
    """spec.training.overlap: a lone replica's push k is computed from the parameters after
    push k-2 (k-1's exchange is still on the wire), and names those steps: each shard counts
    it one behind, applies it, and the replica's model still learns."""
    dataset = data.load(jobspec.Data(source="builtin:digits", test_fraction=0.2, seed=0))
    model = models.build_model(jobspec.Model(type="softmax"), dataset.n_features, dataset.n_classes)
    layout = Layout.of(model.shapes, shards=2)
    live = start_shards(tmp_path, layout, model.init_params(0), optimizer="adagrad", learning_rate=0.1)
    stop, registry = threading.Event(), prom.CollectorRegistry()
    worker = Worker(jobspec.Training(batch_size=16, overlap=True), live.group(), model, dataset,
                    WorkerMetrics(registry), seed=3, stop=stop)
    ended: list[str] = []
    thread = threading.Thread(target=lambda: ended.append(worker.run()), daemon=True)
    try:
        thread.start()
        while min(s.step for s in live.shards) < 300 and thread.is_alive():
            stop.wait(0.05)
    finally:
        stop.set()
        thread.join(10)
        params = np.concatenate([live.params(i) for i in range(layout.shards)])
        live.stop()
    assert ended == ["stopped"]
    assert [s.step for s in live.shards] == worker.acknowledged == [worker.steps] * 2  # none lost, none refused
    assert all(s.metrics.staleness_max._value.get() == 1 for s in live.shards)
    behind = {b: registry.get_sample_value("distbelief_worker_staleness_updates_bucket", {"le": b})
              for b in ("0.0", "1.0")}
    assert behind == {"0.0": 2, "1.0": 2 * worker.steps}  # per shard: the first push alone came from fresh parameters
    accuracy = float(np.mean(model.predict(params, dataset.x_test) == dataset.y_test))
    assert accuracy > 0.85, accuracy


def test_the_median_and_the_largest_staleness_are_read_from_shard_0s_metrics() -> None:
    registry = prom.CollectorRegistry()
    metrics = ShardMetrics(registry, 0)
    for staleness in (0, 0, 1, 3, 5):
        metrics.staleness.observe(staleness)
    metrics.staleness_max.set(5)
    figures = scrape.parse(prom.generate_latest(registry).decode())
    assert (figures.staleness_max, figures.staleness_p50) == (5, 1.0)  # 3 of 5 at most 1 behind
    assert scrape.parse(prom.generate_latest(prom.CollectorRegistry()).decode()).staleness_p50 is None


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
def test_a_local_job_with_a_staleness_bound_honours_it_and_reports_it(tmp_path: Path, overlap: bool) -> None:
    """Overlapped replicas too (spec.training.overlap): their gradients are one update staler,
    and the bound still holds for every update applied."""
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["training"].update(maxStaleness=1, overlap=overlap)
    code = local.LocalRun(DistBeliefJob.validated(doc), str(tmp_path)).run(progress=False)
    summary = json.loads((tmp_path / "report.json").read_text())
    assert code == 0 and summary["accuracy"] >= 0.9
    assert summary["staleness"]["max"] <= 1 and summary["staleness"]["p50"] <= 1
    replica_log = (tmp_path / "logs" / "digits-worker-0.log").read_text()
    assert ("event=overlapped" in replica_log) is overlap
