"""Sandblaster L-BFGS building blocks: the driver against scipy, the work queue's backup
tasks, and the whole method over real shards, a coordinator and replicas on loopback."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import prometheus_client as prom
import pytest
import scipy.optimize

from distbelief.runtime import data, errors, models, protocol
from distbelief.runtime.client import ShardGroup, Timeouts
from distbelief.runtime.layout import Layout
from distbelief.runtime.metrics import CoordinatorMetrics, ShardMetrics, WorkerMetrics
from distbelief.runtime.protocol import VectorCode, VectorCommand
from distbelief.runtime.sandblaster.coordinator import Coordinator, CoordinatorSettings
from distbelief.runtime.sandblaster.lbfgs import Lbfgs, LbfgsSettings
from distbelief.runtime.sandblaster.replica import CoordinatorLink, Replica
from distbelief.runtime.sandblaster.vectors import ShardVectors, Slots
from distbelief.runtime.sandblaster.workqueue import WorkQueue
from distbelief.runtime.shard import Shard, ShardSettings

HISTORY = 5


@pytest.fixture(scope="module")
def convex_problem():
    """L2-regularised softmax regression on digits, and scipy's L-BFGS-B optimum of it."""
    dataset = data.load({"source": "builtin:digits", "testFraction": 0.2, "seed": 0})
    model = models.build_model({"type": "softmax", "l2": 1e-3}, dataset.n_features, dataset.n_classes)
    x0 = model.init_params(0)

    def objective(w):
        f, g = model.loss_and_grad(w.astype(np.float32), (dataset.x_train, dataset.y_train))
        return f, g.astype(np.float64)

    best = scipy.optimize.minimize(objective, x0.astype(np.float64), jac=True, method="L-BFGS-B",
                                   options={"maxiter": 5000, "gtol": 1e-9, "ftol": 1e-15})
    return dataset, model, x0, best.fun


class ArraySpace:
    """lbfgs.VectorSpace on plain arrays in this process."""

    def __init__(self, model, dataset, x0):
        self.v = [np.zeros_like(x0) for _ in range(Slots(HISTORY).count)]
        self.v[Slots.X][...] = x0
        self.model, self.batch = model, (dataset.x_train, dataset.y_train)

    def dot(self, a, b):
        return float(np.dot(self.v[a].astype(np.float64), self.v[b].astype(np.float64)))

    def axpy(self, out, alpha, a):
        self.v[out] += np.float32(alpha) * self.v[a]

    def scale(self, out, alpha):
        self.v[out] *= np.float32(alpha)

    def copy(self, out, a):
        self.v[out][...] = self.v[a]

    def evaluate(self):
        f, g = self.model.loss_and_grad(self.v[Slots.XT], self.batch)
        self.v[Slots.GT][...] = g
        return f


def test_the_driver_reaches_scipys_optimum(convex_problem):
    dataset, model, x0, optimum = convex_problem
    lbfgs = Lbfgs(ArraySpace(model, dataset, x0), LbfgsSettings(history=HISTORY, gradient_tolerance=1e-6))
    state = lbfgs.initialize()
    while state.converged is None and state.iteration < 1000:
        state = lbfgs.iterate(state)
    assert state.converged is not None and state.iteration > 10
    assert abs(state.objective - optimum) / optimum < 1e-4


# -- the work queue ------------------------------------------------------------------------


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_units_go_out_in_order_then_as_backups_and_the_first_result_wins():
    queue = WorkQueue(total=100, unit_size=30, backups=True, clock=Clock())
    queue.begin(7)
    assert queue.units == 4
    units = [queue.assign(worker) for worker in (1, 2, 3, 1)]
    assert [(u.start, u.stop) for u in units] == [(0, 30), (30, 60), (60, 90), (90, 100)]
    for unit, worker in zip(units[1:], (2, 3, 1)):
        assert queue.complete(worker, 7, unit.unit, 0.25)
    backup = queue.assign(2)          # replica 1's first unit is the only one left
    assert backup.unit == units[0].unit and queue.stats.backups == 1
    assert queue.assign(1) is None    # it holds that unit already: nothing useful for it
    assert queue.complete(2, 7, backup.unit, 0.25) and queue.finished
    assert not queue.complete(1, 7, units[0].unit, 0.25)  # the straggler's copy is dropped
    assert queue.stats.duplicates == 1 and queue.objective == pytest.approx(1.0)
    assert not queue.complete(1, 6, 0, 9.0)               # a result of an old evaluation


def test_without_backups_a_unit_goes_out_again_only_after_it_went_quiet():
    clock = Clock()
    queue = WorkQueue(total=10, unit_size=10, backups=False, reissue_after=30.0, clock=clock)
    queue.begin(1)
    assert queue.assign(1).unit == 0
    assert queue.assign(2) is None
    clock.now = 31.0                  # replica 1 died holding it
    assert queue.assign(2).unit == 0


# -- the shard's vector ops ------------------------------------------------------------------


def start_vector_shards(folder: Path, layout: Layout, initial: np.ndarray) -> list[Shard]:
    shards = []
    for index in range(layout.shards):
        shard = Shard(ShardSettings(shard=index, bind="tcp://127.0.0.1:*", checkpoint_dir=str(folder / f"shard-{index}"),
                                    checkpoint_every=3600),
                      layout, initial, ShardMetrics(prom.CollectorRegistry(), index))
        ShardVectors(shard, HISTORY)
        shard.restore()
        threading.Thread(target=shard.serve, daemon=True).start()
        assert shard.ready.wait(10)
        shards.append(shard)
    return shards


def group_of(shards: list[Shard], layout: Layout, **kwargs) -> ShardGroup:
    return ShardGroup([s.endpoint for s in shards], layout, timeouts=Timeouts(request=2.0, unavailable=20.0), **kwargs)


def test_vector_ops_run_on_each_slice_and_refuse_bad_commands(tmp_path):
    layout = Layout.of([("w", (40,)), ("b", (9,))], shards=2)
    initial = np.arange(layout.total, dtype=np.float32)
    shards = start_vector_shards(tmp_path, layout, initial)
    group = group_of(shards, layout)
    try:
        group.vector(VectorCommand(code=VectorCode.COPY, out=Slots.D, a=Slots.X))
        group.vector(VectorCommand(code=VectorCode.SCALE, out=Slots.D, scalar=2.0))
        replies = group.vector(VectorCommand(code=VectorCode.DOT, a=Slots.X, b=Slots.D))
        parts = [protocol.VectorResult.unpack(r.payload).value for r in replies]
        assert sum(parts) == pytest.approx(2 * float(np.dot(initial, initial)))
        assert all(p > 0 for p in parts)   # each shard answered for its own slice
        with pytest.raises(errors.ShardRefused, match="slot"):
            group.vector(VectorCommand(code=VectorCode.COPY, out=Slots(HISTORY).count, a=0))
        with pytest.raises(errors.ShardRefused, match="not served"):
            group.push(np.ones(layout.total, np.float32), steps=[0, 0], examples=1, loss=0.1)
        # A unit's gradient counts once per evaluation: a backup's duplicate is dropped.
        group.begin_evaluation(5, units=2)
        ones = np.ones(layout.total, np.float32)
        assert [r.header.count for r in group.accumulate(ones, evaluation=5, unit=1)] == [1, 1]
        assert [r.header.count for r in group.accumulate(ones, evaluation=5, unit=1)] == [0, 0]
        assert [r.header.count for r in group.accumulate(ones, evaluation=4, unit=0)] == [0, 0]
        replies = group.vector(VectorCommand(code=VectorCode.DOT, a=Slots.GT, b=Slots.GT))
        assert sum(protocol.VectorResult.unpack(r.payload).value for r in replies) == layout.total
    finally:
        group.close()
        for shard in shards:
            shard.stop()


# -- the whole method on loopback ------------------------------------------------------------


def run_sandblaster(folder, dataset, model, x0, *, replicas=2, shards=2, iterations=1000):
    layout = Layout.of(model.shapes, shards)
    live = start_vector_shards(folder, layout, x0)
    stop = threading.Event()
    settings = CoordinatorSettings(bind="tcp://127.0.0.1:*", examples=len(dataset.x_train), unit_size=64,
                                   max_iterations=iterations,
                                   lbfgs=LbfgsSettings(history=HISTORY, gradient_tolerance=1e-6))
    coordinator = Coordinator(settings, group_of(live, layout), CoordinatorMetrics(prom.CollectorRegistry()),
                              stop=stop)
    coordinator.start()
    workers = []
    for _ in range(replicas):
        group = group_of(live, layout, stop=stop)
        link = CoordinatorLink(coordinator.endpoint, worker_id=group.worker_id, layout=layout.hash, curve=None,
                               stop=stop)
        replica = Replica(group, link, model, dataset, WorkerMetrics(prom.CollectorRegistry()), stop=stop)
        thread = threading.Thread(target=lambda r=replica: _quietly(r.run), daemon=True)
        thread.start()
        workers.append(thread)
    return live, coordinator, stop


def _quietly(run):
    try:
        run()
    except errors.Stopped:
        pass


def test_distributed_lbfgs_matches_scipy_on_a_convex_problem(tmp_path, convex_problem):
    dataset, model, x0, optimum = convex_problem
    shards, coordinator, stop = run_sandblaster(tmp_path, dataset, model, x0)
    try:
        deadline_checks = 0
        while (coordinator.state is None or coordinator.state.converged is None) and deadline_checks < 600:
            stop.wait(0.5)
            deadline_checks += 1
        state = coordinator.state
        assert state is not None and state.converged is not None, "did not converge"
        assert abs(state.objective - optimum) / optimum < 1e-4
        # The trained parameters are the shards' X: held-out accuracy of the convex optimum.
        params = np.concatenate([s.params for s in shards])
        _, accuracy = models.evaluate(model, params, dataset.x_test, dataset.y_test)
        assert accuracy > 0.93
        assert shards[0].step == state.iteration   # every iteration was committed
    finally:
        stop.set()
        coordinator.stop()
        for shard in shards:
            shard.stop()
