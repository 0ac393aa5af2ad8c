"""Sandblaster L-BFGS building blocks: the driver against scipy, the work queue's backup
tasks, and the whole method over real shards, a coordinator and replicas on loopback."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import numpy as np
import prometheus_client as prom
import pytest
import scipy.optimize
import zmq

from support import shards as shards_support
from support.examples import load_example
from distbelief.operator.local import local, report
from distbelief.operator.render import render
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import scrape
from distbelief.runtime import contract, errors, jobspec
from distbelief.runtime.algorithms.sandblaster import ops
from distbelief.runtime.algorithms.sandblaster.coordinator import Coordinator, CoordinatorSettings
from distbelief.runtime.algorithms.sandblaster.lbfgs import Lbfgs, LbfgsSettings
from distbelief.runtime.algorithms.sandblaster.ops import SandblasterShards, VectorCode, VectorCommand
from distbelief.runtime.algorithms.sandblaster.replica import CoordinatorLink, Replica
from distbelief.runtime.algorithms.sandblaster.vectors import ShardVectors, Slots
from distbelief.runtime.algorithms.sandblaster.workqueue import WorkQueue
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.model import data, models
from distbelief.runtime.observe.metrics import CoordinatorMetrics, WorkerMetrics
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.shard.core import Shard
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.layout import Layout

HISTORY = 5


@pytest.fixture(scope="module")
def convex_problem():
    """L2-regularised softmax regression on digits, and scipy's L-BFGS-B optimum of it."""
    dataset = data.load(jobspec.Data(source="builtin:digits", test_fraction=0.2, seed=0))
    model = models.build_model(jobspec.Model(type="softmax", l2=1e-3), dataset.n_features, dataset.n_classes)
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


def test_units_go_out_in_order_then_as_backups_of_stragglers_and_the_first_result_wins():
    clock = Clock()
    queue = WorkQueue(total=100, unit_size=30, backups=True, clock=clock)
    queue.begin(7)
    assert queue.units == 4
    units = [queue.assign(worker) for worker in (1, 2, 3, 1)]
    assert [(u.start, u.stop) for u in units] == [(0, 30), (30, 60), (60, 90), (90, 100)]
    clock.now = 1.0
    for unit, worker in zip(units[1:], (2, 3, 1)):
        assert queue.complete(worker, 7, unit.unit, 0.25)
    # Replica 1's first unit is the only one left, out for 1 s, as long as the others took.
    assert queue.assign(2) is None and queue.stats.backups == 0  # not a straggler yet
    clock.now = 2.0 + 1e-6                                     # out longer than BACKUP_AFTER x 1 s
    backup = queue.assign(2)
    assert backup.unit == units[0].unit and queue.stats.backups == 1
    assert queue.assign(1) is None    # it holds that unit already: nothing useful for it
    assert queue.complete(2, 7, backup.unit, 0.25) and queue.finished
    assert not queue.complete(1, 7, units[0].unit, 0.25)  # the straggler's copy is dropped
    assert queue.stats.duplicates == 1 and queue.objective == pytest.approx(1.0)
    assert not queue.complete(1, 6, 0, 9.0)               # a result of an old evaluation


def test_no_backup_goes_out_before_a_unit_is_done_to_time_the_others_by():
    clock = Clock()
    queue = WorkQueue(total=40, unit_size=10, backups=True, clock=clock)
    queue.begin(3)
    assert [queue.assign(w).unit for w in (1, 2, 3, 4)] == [0, 1, 2, 3]
    clock.now = 20.0
    assert queue.assign(5) is None and queue.stats.backups == 0
    clock.now = 31.0                  # but a unit gone quiet goes out again, as without backups
    assert queue.assign(5).unit == 0


def test_a_unit_is_held_only_by_the_replicas_it_went_to_in_its_evaluation():
    """The coordinator takes a result (or a 'lost' that forces a rollback) only from them."""
    clock = Clock()
    queue = WorkQueue(100, 50, backups=True, clock=clock)
    queue.begin(7)
    assert queue.assign(b"a").unit == 0 and queue.assign(b"b").unit == 1
    assert queue.holds(b"a", 7, 0) and not queue.holds(b"b", 7, 0) and not queue.holds(b"a", 6, 0)
    assert queue.complete(b"a", 7, 0, 0.5)
    assert queue.holds(b"a", 7, 0)  # a late copy of a done unit still comes from a holder
    queue.begin(8)
    assert not queue.holds(b"a", 8, 0)


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
    return shards_support.start_vector_shards(folder, layout, initial, HISTORY).shards


def group_of(shards: list[Shard], layout: Layout, **kwargs) -> ShardGroup:
    return ShardGroup([s.endpoint for s in shards], layout, timeouts=Timeouts(request=2.0, unavailable=20.0), **kwargs)


def test_a_repeated_vector_command_gets_its_first_reply_and_acts_once(tmp_path):
    """The coordinator resends a command whose reply it lost: an AXPY applied twice would
    silently corrupt the search direction."""
    layout = Layout.of([("w", (6,))], shards=1)
    [shard] = start_vector_shards(tmp_path, layout, np.arange(6, dtype=np.float32))
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(shard.endpoint)
    axpy = VectorCommand(code=VectorCode.AXPY, out=Slots.D, a=Slots.X, scalar=2.0).pack()
    replies = []
    try:
        for seq in (5, 5, 6):
            header = protocol.Header(op=ops.VECTOR.code, shard=0, layout=layout.hash, seq=seq, worker=9)
            peer.send_multipart([header.pack(), axpy])
            assert peer.poll(5000)
            replies.append([protocol.unpack_header(f).seq if i == 0 else f for i, f in
                            enumerate(peer.recv_multipart())])
            if len(replies) == 2:
                np.testing.assert_array_equal(shard.plugin(ShardVectors).vectors[Slots.D], 2 * np.arange(6))
    finally:
        peer.close()
        shard.stop()
    assert replies[0] == replies[1] and replies[2][0] == 6
    np.testing.assert_array_equal(shard.plugin(ShardVectors).vectors[Slots.D], 4 * np.arange(6))  # seq 6 is a new command


def test_vector_ops_run_on_each_slice_and_refuse_bad_commands(tmp_path):
    layout = Layout.of([("w", (40,)), ("b", (9,))], shards=2)
    initial = np.arange(layout.total, dtype=np.float32)
    shards = start_vector_shards(tmp_path, layout, initial)
    group = group_of(shards, layout)
    sandblaster = SandblasterShards(group)
    try:
        sandblaster.vector(VectorCommand(code=VectorCode.COPY, out=Slots.D, a=Slots.X))
        sandblaster.vector(VectorCommand(code=VectorCode.SCALE, out=Slots.D, scalar=2.0))
        replies = sandblaster.vector(VectorCommand(code=VectorCode.DOT, a=Slots.X, b=Slots.D))
        parts = [r.meta.value for r in replies]
        assert sum(parts) == pytest.approx(2 * float(np.dot(initial, initial)))
        assert all(p > 0 for p in parts)   # each shard answered for its own slice
        with pytest.raises(errors.ShardRefused, match="slot"):
            sandblaster.vector(VectorCommand(code=VectorCode.COPY, out=Slots(HISTORY).count, a=0))
        with pytest.raises(errors.ShardRefused, match="scalar"):
            sandblaster.vector(VectorCommand(code=VectorCode.SCALE, out=Slots.D, scalar=1e300))
        # A unit's gradient counts once per evaluation: a backup's duplicate is dropped.
        sandblaster.begin_evaluation(5, units=2)
        ones = np.ones(layout.total, np.float32)
        assert [r.meta.added for r in sandblaster.accumulate(ones, evaluation=5, unit=1)] == [1, 1]
        assert [r.meta.added for r in sandblaster.accumulate(ones, evaluation=5, unit=1)] == [0, 0]
        assert [r.meta.added for r in sandblaster.accumulate(ones, evaluation=4, unit=0)] == [0, 0]
        replies = sandblaster.vector(VectorCommand(code=VectorCode.DOT, a=Slots.GT, b=Slots.GT))
        assert sum(r.meta.value for r in replies) == layout.total
    finally:
        group.close()
        for shard in shards:
            shard.stop()


@pytest.mark.parametrize("push", ["push", "push_and_pull"])
def test_a_sandblaster_shard_applies_no_downpour_push(tmp_path, push):
    """Its parameters move only by the coordinator's vector ops: a push of either kind
    is refused and changes nothing."""
    layout = Layout.of([("w", (12,))], shards=1)
    initial = np.arange(layout.total, dtype=np.float32)
    [shard] = start_vector_shards(tmp_path, layout, initial)
    group = group_of([shard], layout)
    ones = np.ones(layout.total, np.float32)
    try:
        with pytest.raises(errors.ShardRefused, match="not served"):
            if push == "push":
                Float32Dense(group).push(ones, steps=[0], examples=1, loss=0.1)
            else:
                Float32Dense(group).push_and_pull(ones, np.empty_like(ones), steps=[0], examples=1, loss=0.1)
        np.testing.assert_array_equal(shard.plugin(DenseSlice).params, initial)
        assert shard.step == 0
    finally:
        group.close()
        shard.stop()


# -- the whole method on loopback ------------------------------------------------------------


class SlowModel:
    """A replica's model that takes `delay` seconds longer per work unit."""

    def __init__(self, model, delay):
        self.model, self.delay = model, delay

    def loss_and_grad(self, params, batch, out=None):
        time.sleep(self.delay)
        return self.model.loss_and_grad(params, batch, out=out)


def run_sandblaster(folder, dataset, model, x0, *, replicas=2, shards=2, iterations=1000, backups=True,
                    delays=()):
    layout = Layout.of(model.shapes, shards)
    live = start_vector_shards(folder, layout, x0)
    stop = threading.Event()
    settings = CoordinatorSettings(bind="tcp://127.0.0.1:*", examples=len(dataset.x_train), unit_size=64,
                                   max_iterations=iterations, backups=backups,
                                   lbfgs=LbfgsSettings(history=HISTORY, gradient_tolerance=1e-6))
    coordinator = Coordinator(settings, group_of(live, layout), CoordinatorMetrics(prom.CollectorRegistry()),
                              stop=stop)
    coordinator.start()
    workers = []
    for i in range(replicas):
        group = group_of(live, layout, stop=stop)
        link = CoordinatorLink(coordinator.endpoint, worker_id=group.worker_id, layout=layout.hash, security=None,
                               stop=stop)
        own_model = SlowModel(model, delays[i]) if i < len(delays) else model
        replica = Replica(group, link, own_model, dataset, WorkerMetrics(prom.CollectorRegistry()), stop=stop)
        thread = threading.Thread(target=lambda r=replica: _quietly(r.run), daemon=True)
        thread.start()
        workers.append(thread)
    return live, coordinator, stop


def _quietly(run):
    try:
        run()
    except errors.Stopped:
        pass


@pytest.mark.heavy
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
        params = np.concatenate([s.plugin(DenseSlice).params for s in shards])
        _, accuracy = models.evaluate(model, params, dataset.x_test, dataset.y_test)
        assert accuracy > 0.93
        assert shards[0].step == state.iteration   # every iteration was committed
    finally:
        stop.set()
        coordinator.stop()
        for shard in shards:
            shard.stop()


def _evaluation_seconds(folder, convex_problem, **options) -> tuple[float, Coordinator]:
    """Mean seconds per evaluation over 3 iterations with 3 replicas."""
    dataset, model, x0, _ = convex_problem
    shards, coordinator, stop = run_sandblaster(folder, dataset, model, x0, replicas=3, iterations=3, **options)
    try:
        for _ in range(600):
            if coordinator.state is not None and coordinator.state.iteration >= 3:
                break
            stop.wait(0.2)
        histogram = coordinator.metrics.evaluation_seconds
        samples = {s.name: s.value for s in histogram.collect()[0].samples}
        return (samples["distbelief_sandblaster_evaluation_seconds_sum"]
                / samples["distbelief_sandblaster_evaluation_seconds_count"]), coordinator
    finally:
        stop.set()
        coordinator.stop()
        for shard in shards:
            shard.stop()


SLOW = 0.25  # seconds a straggler adds to each work unit (the others take about a millisecond)


def test_backup_tasks_keep_a_slow_replica_from_holding_up_the_batch(tmp_path, convex_problem):
    """One replica of three takes SLOW s longer per unit. With backups, its units are
    redone by the others once they straggle, and its late results dropped; the factor
    against a run with no straggler is printed (docs/benchmarks.md), not asserted: it is
    wall time."""
    clean, _ = _evaluation_seconds(tmp_path / "clean", convex_problem)
    without, plain = _evaluation_seconds(tmp_path / "no-backups", convex_problem, backups=False, delays=[SLOW])
    slowed, coordinator = _evaluation_seconds(tmp_path / "backups", convex_problem, delays=[SLOW])
    stats = coordinator.queue.stats
    assert stats.backups > 0
    assert plain.queue.stats.backups == 0
    print(f"evaluation seconds: clean {clean:.3f}, straggler without backups {without:.3f}, "
          f"with backups {slowed:.3f}; factors {without / clean:.1f}x and {slowed / clean:.1f}x")


# -- the example job in local mode, with a replica and a shard killed --------------------------


def _step(run: local.LocalRun) -> int:
    try:
        return scrape.read(f"http://127.0.0.1:{run.shards[0].ports[contract.METRICS_PORT_NAME]}/metrics").global_step or 0
    except Exception:
        return 0  # shard 0 is restarting


def _kill_when(run: local.LocalRun, thread: threading.Thread, pod: local.LocalPod, step: int) -> bool:
    while thread.is_alive():
        if _step(run) >= step and pod.running:
            pod.process.send_signal(signal.SIGKILL)
            return True
        time.sleep(0.05)
    return False


@pytest.mark.heavy
@pytest.mark.slow
def test_the_example_converges_locally_through_a_replica_and_a_shard_kill(tmp_path, convex_problem):
    _, _, _, optimum = convex_problem
    doc = load_example("digits-sandblaster.yaml")
    run = local.LocalRun(DistBeliefJob.validated(doc), str(tmp_path))
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run.run(progress=False)), daemon=True)
    thread.start()
    try:
        replica = next(p for p in run.pods if p.role == contract.ROLE_WORKER)
        killed = [_kill_when(run, thread, replica, 5), _kill_when(run, thread, run.shards[1], 20)]
        thread.join(timeout=300)
    finally:
        run.interrupt()
        thread.join(timeout=60)
    assert killed == [True, True], "the run ended before both kills"
    assert codes == [0]
    summary = json.loads((tmp_path / report.REPORT_FILE).read_text())
    assert summary["phase"] == "Succeeded" and summary["reason"] == "Converged"
    assert summary["accuracy"] >= 0.93
    assert summary["restartsByPod"][run.shards[1].name] == 1
    assert summary["pods"][run.shards[1].name]["restarts"] == 1
    # The coordinator's and the replicas' sockets count too, not only the shards' serving ones.
    assert all(pod["bytesIn"] > 0 and pod["bytesOut"] > 0 for pod in summary["pods"].values()), summary["pods"]
    result = json.loads((Path(run.chief_dir) / contract.RESULT_FILE).read_text())
    assert abs(result["objective"] - optimum) / optimum < 1e-4
    shard_log = (tmp_path / "logs" / f"{run.shards[0].name}.log").read_text()
    assert "event=recovering" in shard_log and "event=resumed" in shard_log


# -- rendering: the coordinator's port beside shard 0 ------------------------------------------


def test_a_sandblaster_job_exposes_the_coordinator_port_beside_shard_0():
    doc = load_example("digits-sandblaster.yaml")
    doc["spec"]["parameterServers"]["networkPolicy"] = True
    objects = render.render_children(DistBeliefJob.validated(doc), image="distbelief:test")
    by_kind = {o["kind"]: o for o in objects}
    ports = {p["name"]: p["containerPort"]
             for p in by_kind["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports[contract.COORDINATOR_PORT_NAME] == contract.COORDINATOR_PORT
    assert contract.COORDINATOR_PORT in [p["port"] for p in by_kind["Service"]["spec"]["ports"]]
    job_ingress = by_kind["NetworkPolicy"]["spec"]["ingress"][0]["ports"]
    assert {p["port"] for p in job_ingress} == {doc["spec"]["parameterServers"].get("port", 7070),
                                                contract.BULK_PORT, contract.COORDINATOR_PORT}

    downpour = render.render_children(DistBeliefJob.validated(load_example("digits-mlp.yaml")), image="distbelief:test")
    sts = next(o for o in downpour if o["kind"] == "StatefulSet")
    assert contract.COORDINATOR_PORT_NAME not in {p["name"] for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]}
