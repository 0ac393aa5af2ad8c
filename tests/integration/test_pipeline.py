"""Partitioned replicas on loopback: groups by rendezvous, training, and steps applied on
every shard or on none."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import prometheus_client as prom
import pytest

from support.shards import start_shards
from distbelief.runtime import contract, errors, jobspec
from distbelief.runtime.algorithms.chief import WholeModel
from distbelief.runtime.algorithms.downpour.worker import Worker
from distbelief.runtime.algorithms.pipeline.evaluation import StagedModel
from distbelief.runtime.algorithms.pipeline import staged
from distbelief.runtime.algorithms.pipeline.ops import FETCH, FORWARD, PREFETCH, PUSH, Forward, Held
from distbelief.runtime.algorithms.pipeline.rendezvous import RendezvousLink
from distbelief.runtime.model.job import Job
from distbelief.runtime.model.models import evaluate
from distbelief.runtime.model.stages import plan
from distbelief.runtime.observe.metrics import WorkerMetrics
from distbelief.runtime.roles import common
from distbelief.runtime.transport import zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.protocol import Status
from support.partitioned import cluster, run_in_thread  # noqa: F401 (cluster: a fixture)
from support.waiting import eventually

@pytest.mark.parametrize("partitions,shards", [(2, 2), (3, 4)])
def test_a_partitioned_replica_trains_digits(cluster, partitions: int, shards: int) -> None:
    c = cluster(partitions, shards)
    pods = [c.pod(k) for k in range(partitions)]
    threads = [run_in_thread(p) for p in pods]
    eventually(lambda: pods[0].steps >= 600, 120)
    c.stop.set()
    for t in threads:
        t.join(timeout=10)
    steps = c.steps()
    assert len(set(steps)) == 1 and steps[0] >= 590  # every step applied on every shard
    _, accuracy = evaluate(c.model, c.params(), c.dataset.x_test, c.dataset.y_test)
    assert accuracy >= 0.85


def test_each_partition_pulls_and_holds_only_on_its_own_shards(cluster) -> None:
    c = cluster(2, 4)
    pods = [c.pod(k) for k in range(2)]
    assert pods[0].links.own.indices == [0, 1] and pods[1].links.own.indices == [2, 3]
    assert pods[0].params.size + pods[1].params.size == c.layout.total
    threads = [run_in_thread(p) for p in pods]
    eventually(lambda: pods[0].steps >= 20, 60)
    c.stop.set()
    for t in threads:
        t.join(timeout=10)
    later_bytes = pods[1].links.own.bytes_out
    assert later_bytes < 4 * 22 * pods[1].params.nbytes  # its stage's slice per step, not the model's


def test_a_group_that_loses_a_pod_applies_nothing_half_and_re_forms(cluster) -> None:
    c = cluster(2, 2)
    first, doomed_stop = c.pod(0), threading.Event()
    doomed = c.pod(1, stop=doomed_stop)
    threads = [run_in_thread(first), run_in_thread(doomed)]
    eventually(lambda: first.steps >= 30, 60)
    doomed_stop.set()          # partition 1 leaves mid-run: its group breaks
    threads[1].join(timeout=10)
    doomed.server.close()
    replacement = c.pod(1)
    threads.append(run_in_thread(replacement))
    eventually(lambda: replacement.steps >= 30, 60)
    assert c.rendezvous.groups.formed >= 2
    c.stop.set()
    for t in threads:
        t.join(timeout=10)
    steps = c.steps()
    assert steps[0] == steps[1] >= 60


class StageByHand:
    """Partition 0 played by the test: joins a group with a running stage 1 and sends it
    requests one at a time."""

    def __init__(self, c, later) -> None:
        self.c, self.width = c, later.stage.input_width
        self.me = RendezvousLink(c.rendezvous.endpoint, partition=0, me="tester", worker_id=1, layout=c.layout.hash,
                                 security=None, stop=threading.Event())
        view = self.me.wait_for_group()
        self.group = view["group"]
        self.tp = zmq_transport.default()
        self.link = self.tp.link(view["downstream"], None, watch=False)

    def rows(self, labels: list[float]) -> np.ndarray:
        return np.concatenate([np.zeros(len(labels) * self.width, np.float32), np.array(labels, np.float32)])

    def forward(self, seq: int, group: int, body: np.ndarray, *, token: int = 5, flags: int = 0, part: int = 0,
                parts: int = 1):
        rows = body.size // (self.width + 1)
        header = protocol.Header(op=FORWARD.code, shard=0, layout=self.c.layout.hash, seq=seq, count=body.size)
        meta = Forward(group, token, rows, self.width, flags, part=part, parts=parts, step_rows=rows * parts)
        self.link.send([header.pack(), meta.pack(), memoryview(body)])
        return self.receive()

    def receive(self):
        assert self.tp.wait([self.link], 10.0)
        received = self.link.receive()
        return protocol.unpack_header(received.header), received

    def prefetch(self, seq: int, token: int) -> None:
        header = protocol.Header(op=PREFETCH.code, shard=0, layout=self.c.layout.hash, seq=seq)
        self.link.send([header.pack(), Held(self.group, token).pack()])

    def close(self) -> None:
        self.link.close()
        self.me.close()


def test_a_stage_refuses_a_foreign_or_malformed_forward_and_keeps_serving(cluster) -> None:
    c = cluster(2, 2)
    later = c.pod(1)
    thread = run_in_thread(later)
    tester = StageByHand(c, later)
    good = tester.rows([1, 2, 3, 4])
    bad_labels = tester.rows([1, 2, 3, 0.5])
    tester.link.send([b"not a header"])  # dropped: nothing to address an answer to
    assert not tester.tp.wait([tester.link], 0.5)
    header, received = tester.forward(1, tester.group ^ 2, good)
    assert header.status == Status.ERROR and b"group" in bytes(received.frames[0])
    header, received = tester.forward(2, tester.group, bad_labels)
    assert header.status == Status.ERROR and b"labels" in bytes(received.frames[0])
    header, received = tester.forward(3, tester.group, good, part=1, parts=2)  # its step's first part never came
    assert header.status == Status.ERROR and b"out of order" in bytes(received.frames[0])
    header, received = tester.forward(4, tester.group, good)
    assert header.status == Status.OK and header.count == 4 * tester.width
    assert np.isfinite(protocol.float_view(received.frames[1], header.count)).all()
    assert c.steps() == [0, 0]  # no PUSH flag: nothing held, nothing applied
    header, _ = tester.forward(5, tester.group, good, token=6, parts=2)  # the last stage answers each part
    assert header.status == Status.OK
    header, received = tester.forward(6, tester.group, good, token=9)
    assert header.status == Status.ERROR and b"a new step while" in bytes(received.frames[0])
    tester.close()
    c.stop.set()
    thread.join(timeout=10)


def test_a_stage_answers_a_push_with_its_gradient_then_with_its_hold_status(cluster) -> None:
    """The gradient goes back before the stage holds its own (so the stage before it
    computes meanwhile); the second answer comes once the hold is on its shards."""
    c = cluster(2, 2)
    later = c.pod(1)
    thread = run_in_thread(later)
    tester = StageByHand(c, later)
    header, received = tester.forward(1, tester.group, tester.rows([1, 2, 3]), token=11, flags=FETCH | PUSH)
    assert header.status == Status.OK and header.count == 3 * tester.width and len(received.frames) == 2
    header, received = tester.receive()
    assert header.seq == 1 and header.status == Status.OK and received.frames == []
    assert [h.token for h in c.shards.shards[1].plugin(staged.HeldGradients).held.values()] == [11]
    assert c.steps() == [0, 0]  # held, not applied: that is partition 0's to commit
    tester.close()
    c.stop.set()
    thread.join(timeout=10)


def test_a_stage_pulls_on_prefetch_before_its_step_arrives_and_not_again_for_it(cluster) -> None:
    c = cluster(2, 2)
    later = c.pod(1)
    thread = run_in_thread(later)
    tester = StageByHand(c, later)
    eventually(lambda: later.links.own.bytes_in >= later.params.nbytes, 10)   # the group's first pull
    settled = later.links.own.bytes_in
    tester.prefetch(1, token=7)
    eventually(lambda: later.links.own.bytes_in - settled >= later.params.nbytes, 10)  # no FORWARD yet
    prefetched = later.links.own.bytes_in
    header, _ = tester.forward(2, tester.group, tester.rows([1, 2]), token=7, flags=FETCH)
    assert header.status == Status.OK
    assert later.links.own.bytes_in == prefetched   # the step used the prefetched parameters
    header, _ = tester.forward(3, tester.group, tester.rows([1, 2]), token=8, flags=FETCH)
    assert header.status == Status.OK
    assert later.links.own.bytes_in - prefetched >= later.params.nbytes  # a step nobody announced pulls itself
    tester.close()
    c.stop.set()
    thread.join(timeout=10)


@pytest.mark.parametrize("partitions,micro_batches", [(2, 1), (2, 4), (3, 5)])  # 5: micro-batches of 7 and 6 rows
def test_a_partitioned_replica_trains_as_the_whole_model_does(tmp_path: Path, cluster, partitions: int,
                                                              micro_batches: int) -> None:
    """One replica, one step at a time, same minibatches: the partitioned pods apply the same
    updates as an unpartitioned worker, so they end at the same parameters and accuracy,
    whether each minibatch goes through the stages whole or in micro-batches."""
    steps = 300
    c = cluster(partitions, partitions)
    whole_layout = Layout.of(c.model.shapes, 2)
    whole = start_shards(tmp_path / "whole", whole_layout, c.model.init_params(0), learning_rate=0.05,
                         checkpoint_every=3600)
    try:
        stop_whole = threading.Event()
        worker = Worker(jobspec.Training(batch_size=32), whole.group(stop=stop_whole), c.model, c.dataset,
                        WorkerMetrics(prom.CollectorRegistry()), seed=0, stop=stop_whole)
        whole.shards[0].step_reached = lambda step: step >= steps and stop_whole.set()
        try:
            worker.run()
        except errors.Stopped:  # stopped while waiting for the reply to its last push
            pass
        eventually(lambda: [s.step for s in whole.shards] == [steps, steps], 60)  # that push reached both
        expected = np.concatenate([whole.params(i) for i in range(2)])
    finally:
        whole.stop()
    pods = [c.pod(0, seed=0, micro_batches=micro_batches), *(c.pod(k) for k in range(1, partitions))]
    c.shards.shards[0].step_reached = lambda step: step >= steps and c.stop.set()
    threads = [run_in_thread(p) for p in pods]
    for t in threads:
        t.join(timeout=120)
    eventually(lambda: c.steps() == [steps] * partitions, 60)  # the last step's APPLY_HELD reached every shard
    np.testing.assert_allclose(c.params(), expected, rtol=1e-3, atol=1e-5)
    accuracy = evaluate(c.model, c.params(), c.dataset.x_test, c.dataset.y_test)[1]
    assert abs(accuracy - evaluate(c.model, expected, c.dataset.x_test, c.dataset.y_test)[1]) <= 0.01


def test_the_chief_scores_a_partitioned_model_stage_by_stage_as_the_whole(tmp_path: Path, cluster) -> None:
    c = cluster(3, 4)
    pods = [c.pod(k) for k in range(3)]
    threads = [run_in_thread(p) for p in pods]
    eventually(lambda: pods[0].steps >= 50, 60)
    c.stop.set()
    for t in threads:
        t.join(timeout=10)
    parts = plan(c.model, 3).stages
    staged = StagedModel(plan(c.model, 3), [c.shards.group(shards=c.layout.shards_of(s.offset, s.offset + s.size))
                                            for s in parts], c.dataset, max_eval_examples=300)
    whole = WholeModel(c.shards.group(), c.model, c.dataset, max_eval_examples=300)
    got, expected = staged.score(), whole.score()
    assert got.step == expected.step == c.steps()[0]
    assert got.accuracy == expected.accuracy and got.loss == pytest.approx(expected.loss, rel=1e-5)
    staged.save(str(tmp_path / "staged.npz"))
    whole.save(str(tmp_path / "whole.npz"))
    with np.load(tmp_path / "staged.npz") as a, np.load(tmp_path / "whole.npz") as b:
        assert list(a.keys()) == list(b.keys()) == [name for name, _ in c.model.shapes]
        for name in a.keys():
            np.testing.assert_array_equal(a[name], b[name])
    staged.close()
    whole.close()


def partitioned_job(partitions: int = 2):
    config = contract.JobConfig(name="p", namespace="default", written={
        "model": {"type": "mlp", "hiddenLayers": [32, 16], "partitions": partitions},
        "data": {"source": "builtin:digits", "testFraction": 0.2},
        "parameterServers": {"shards": 2, "port": 7070}})
    return Job(config)


def test_a_partition_pod_reads_its_partition_and_stage_address_from_its_environment() -> None:
    job = partitioned_job()
    env = {contract.ENV_PARTITION: "1", contract.ENV_STAGE_ADDRESS: "tcp://10.0.0.7:7172"}
    stage = common.stage_access(job, common.Access(), "0.0.0.0", env)
    assert (stage.partition, stage.bind, stage.address) == (1, "tcp://0.0.0.0:7172", "tcp://10.0.0.7:7172")
    assert job.stage_shards(0) == [0] and job.stage_shards(1) == [1]
    first = common.stage_access(job, common.Access(), "0.0.0.0", {contract.ENV_PARTITION: "0"})
    assert first.partition == 0 and first.bind is None


@pytest.mark.parametrize("env,problem", [({}, "DISTBELIEF_PARTITION=''"),
                                         ({contract.ENV_PARTITION: "2"}, "0..1"),
                                         ({contract.ENV_PARTITION: "1"}, "DISTBELIEF_STAGE_ADDRESS")])
def test_a_partition_pod_without_a_usable_environment_stops_with_a_config_error(env, problem) -> None:
    with pytest.raises(errors.ConfigError, match=problem):
        common.stage_access(partitioned_job(), common.Access(), "0.0.0.0", env)


def test_a_job_with_fewer_shards_than_partitions_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="at least spec.model.partitions"):
        partitioned_job(partitions=3)
