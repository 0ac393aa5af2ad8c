"""The transport's in-process twin: a shard core, its dense slice and a replica's client,
talking without a socket; and the one retry policy every client uses."""

from __future__ import annotations

import threading

import numpy as np
import prometheus_client as prom
import pytest

from distbelief.runtime import errors
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.params.optim import Sgd
from distbelief.runtime.shard.core import Shard, ShardSettings
from distbelief.runtime.transport.memory_transport import MemoryTransport
from distbelief.runtime.wire.layout import Layout

LAYOUT = Layout.of([("w", (5, 4)), ("b", (4,))], shards=2)


def _serve(net: MemoryTransport, tmp_path, *, pushes: bool = True) -> list[tuple[Shard, threading.Thread]]:
    served = []
    for index in range(LAYOUT.shards):
        shard = Shard(ShardSettings(shard=index, bind=f"shard-{index}", checkpoint_dir=str(tmp_path / str(index))),
                      LAYOUT, ShardMetrics(prom.CollectorRegistry(), index), transport_=net)
        shard.attach(DenseSlice(shard, np.zeros(LAYOUT.total, np.float32), optimizer="sgd", learning_rate=0.5,
                                pushes=pushes))
        shard.restore()
        thread = threading.Thread(target=shard.serve, daemon=True)
        thread.start()
        assert shard.ready.wait(5)
        served.append((shard, thread))
    return served


def test_shards_and_a_replica_train_through_the_in_process_transport(tmp_path) -> None:
    net = MemoryTransport()
    served = _serve(net, tmp_path)
    group = ShardGroup([f"shard-{i}" for i in range(LAYOUT.shards)], LAYOUT, transport_=net,
                       timeouts=Timeouts(request=2.0, unavailable=5.0))
    try:
        assert all(r.meta.size == LAYOUT.size(i) for i, r in enumerate(group.hello()))
        grad = np.arange(LAYOUT.total, dtype=np.float32)
        out = np.empty(LAYOUT.total, np.float32)
        replies = Float32Dense(group).push_and_pull(grad, out, steps=[0, 0], examples=4, loss=0.25)
        expected = np.zeros(LAYOUT.total, np.float32)
        Sgd(LAYOUT.total, 0.5).apply(expected, grad)
        np.testing.assert_array_equal(out, expected)
        assert [r.step for r in replies] == [1, 1]
        assert group.stats()[1]["step"] == 1 and group.bytes_out > grad.nbytes
    finally:
        group.close()
        for shard, thread in served:
            shard.stop()
            thread.join(5)


def test_an_error_reply_is_told_apart_by_its_code_not_its_text(tmp_path) -> None:
    net = MemoryTransport()
    served = _serve(net, tmp_path, pushes=False)
    group = ShardGroup(["shard-0", "shard-1"], LAYOUT, transport_=net, timeouts=Timeouts(request=2.0, unavailable=5.0))
    other = ShardGroup(["shard-0", "shard-1"], Layout.of([("w", (24,))], shards=2), transport_=net,
                       timeouts=Timeouts(request=2.0, unavailable=5.0))
    try:
        with pytest.raises(errors.ShardRefused, match="PUSH: op PUSH is not served") as refused:
            Float32Dense(group).push(np.ones(LAYOUT.total, np.float32), steps=[0, 0], examples=1, loss=0.1)
        assert not isinstance(refused.value, errors.LayoutMismatch)
        with pytest.raises(errors.LayoutMismatch):
            other.hello()
    finally:
        group.close()
        other.close()
        for shard, thread in served:
            shard.stop()
            thread.join(5)


def test_a_silent_peer_is_given_up_after_the_policy_s_time() -> None:
    group = ShardGroup(["nobody-0", "nobody-1"], LAYOUT, transport_=MemoryTransport(),
                       timeouts=Timeouts(request=0.1, unavailable=0.3))
    with pytest.raises(errors.ShardUnavailable, match="shard 0 at nobody-0 has not answered"):
        group.hello()
    assert group.retries >= 2  # each silent attempt was sent again on a fresh link


def test_a_stop_ends_a_wait_at_once() -> None:
    stop = threading.Event()
    stop.set()
    group = ShardGroup(["nobody-0", "nobody-1"], LAYOUT, transport_=MemoryTransport(), stop=stop)
    with pytest.raises(errors.Stopped):
        group.hello()
