"""Copies of one shard on loopback (spec.parameterServers.backups): an update is acknowledged
only once every copy applied it, a resend after a failover is applied once, and a copy that
comes back catches up from the primary and rejoins as its backup."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import prometheus_client as prom
import pytest

from distbelief.runtime import errors, keys
from distbelief.runtime.algorithms.pipeline.ops import APPLY_HELD, HOLD, PREPARE_HELD, ApplyHeld, Held
from distbelief.runtime.algorithms.pipeline.staged import HeldGradient, HeldGradients
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.params import dense
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.params.dense_client import Bfloat16Dense, Float32Dense
from distbelief.runtime.params.optim import Adagrad
from distbelief.runtime.params.rows import rowcheckpoint
from distbelief.runtime.params.rows.row_client import RowClient
from distbelief.runtime.params.rows.sparse import SparseRows
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.copies import forwarding, replication, transfer
from distbelief.runtime.shard.copies.viewstore import FileViewStore
from distbelief.runtime.shard.copies.watch import BACKUP, COPY_STATUS, PRIMARY
from distbelief.runtime.shard.core import Shard, ShardSettings
from distbelief.runtime.transport import fanout, interface, zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.bfloat16 import WIRE_DTYPE, Codec
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.protocol import Header, Status

from support.ports import free_port
from support.waiting import eventually

LAYOUT = Layout.of([("w", (6, 5)), ("b", (5,))], shards=1)
LEASE_SECONDS = 1.5
INITIAL = np.linspace(-1, 1, LAYOUT.total, dtype=np.float32)
UPDATE = dense.Update(examples=4, loss=1.0).pack()


class Copies:
    """Copies of shard 0 serving in threads, each at its fixed loopback address."""

    def __init__(self, folder: Path, count: int = 2, attach: Callable[[Shard], None] = lambda shard: None,
                 wire_format: str = "float32", job_keys: keys.JobKeys | None = None, min_in_sync: int = 1) -> None:
        self.folder, self.attach, self.wire_format, self.job_keys = folder, attach, wire_format, job_keys
        self.min_in_sync = min_in_sync
        self.addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(count)]
        self.shards: list[Shard | None] = [None] * count
        self.threads: list[threading.Thread | None] = [None] * count
        self.store = FileViewStore(str(folder / "views" / "shard-0.json"))

    def start(self, rank: int, *, folder: str | None = None, store: Any = None) -> Shard:
        keyed = self.job_keys is not None  # CurveZMQ, and AES-GCM sessions on a bulk port, as shards of encrypted jobs
        settings = ShardSettings(shard=0, bind=self.addresses[rank], checkpoint_every=3600,
                                 checkpoint_dir=folder or str(self.folder / f"copy-{rank}"),
                                 security=self.job_keys.server_security() if keyed else None,
                                 bulk_bind="tcp://127.0.0.1:*" if keyed else None)
        shard = Shard(settings, LAYOUT, ShardMetrics(prom.CollectorRegistry(), 0))
        shard.attach(DenseSlice(shard, INITIAL, optimizer="adagrad", learning_rate=0.1, wire_format=self.wire_format))
        self.attach(shard)
        shard.serve_copies(replication.Copies(shard, rank=rank, addresses=self.addresses,
                                              security=self.client_options(keys.CHIEF),
                                              store=store or self.store, lease_seconds=LEASE_SECONDS,
                                              min_in_sync=self.min_in_sync))
        shard.restore()
        thread = threading.Thread(target=shard.serve, daemon=True)
        thread.start()
        assert shard.ready.wait(10)
        self.shards[rank], self.threads[rank] = shard, thread
        return shard

    def started(self) -> "Copies":
        """Copies 0 and 1 serving, copy 0 leading with copy 1 in sync."""
        self.start(0)
        self.start(1)
        eventually(lambda: self.in_sync(0, 1), 20, what="copy 0 leads with copy 1 as its backup")
        return self

    def kill(self, rank: int) -> None:
        """End a copy's serving loop and wait until its port is free again."""
        shard, thread = self.shards[rank], self.threads[rank]
        assert shard is not None and thread is not None
        shard.stop()
        thread.join(timeout=10)
        self.shards[rank] = None

    def stop(self) -> None:
        for rank, shard in enumerate(self.shards):
            if shard is not None:
                self.kill(rank)

    def copy(self, rank: int) -> Shard:
        shard = self.shards[rank]
        assert shard is not None
        return shard

    def in_sync(self, primary: int, backups: int) -> bool:
        """Copy `primary` leads, with `backups` other copies in the in-sync set of its view."""
        shard = self.shards[primary]
        return shard is not None and shard.copies.role == PRIMARY and shard.copies.stats()["copies"] == backups + 1

    def client_options(self, role: str) -> dict | None:
        return self.job_keys.client_options(role=role) if self.job_keys is not None else None

    def group(self) -> ShardGroup:
        return ShardGroup([self.addresses], LAYOUT, timeouts=Timeouts(request=1.0, unavailable=30.0),
                          security=self.client_options(keys.REPLICA))


@pytest.fixture
def pair(tmp_path: Path):
    copies = Copies(tmp_path).started()
    yield copies
    copies.stop()


def _params(shard: Shard) -> np.ndarray:
    return shard.plugin(DenseSlice).params


def _push(link: interface.Link, seq: int, grad: np.ndarray) -> Header:
    """One push from a fixed peer (one routing id), sent on to the next copy on a refusal or
    a silence, as a replica's link does; the header of the reply that took it."""
    request = [Header(op=dense.PUSH.code, shard=0, layout=LAYOUT.hash, seq=seq, worker=7, count=grad.size).pack(),
               UPDATE, grad.tobytes()]
    taken: list[Header] = []

    def accept(_: int, received: interface.Received) -> bool | str:
        header = protocol.unpack_header(received.header)
        if header.seq != seq:
            return False  # the answer to an earlier copy of an earlier push
        if header.status == Status.ERROR and header.error == protocol.ErrorCode.NOT_PRIMARY:
            return fanout.REDIRECT
        taken.append(header)
        return True

    policy = fanout.RetryPolicy(attempt=1.0, give_up=30.0)
    fanout.exchange(zmq_transport.default(), fanout.Exchange([link], [request], policy, ["shard 0"]),
                       accept=accept, stop=threading.Event())
    return taken[0]


def test_a_push_is_acknowledged_only_after_the_backup_applied_it(pair: Copies) -> None:
    primary, backup = pair.copy(0), pair.copy(1)
    held, release = threading.Event(), threading.Event()
    forwarded = backup.raw_ops[forwarding.REPLICATE.code]

    def slow_backup(header: Header, incoming: interface.Incoming) -> list:
        held.set()
        release.wait(10)
        return forwarded(header, incoming)

    backup.raw_ops[forwarding.REPLICATE.code] = slow_backup
    group = pair.group()
    replies: list = []
    pushing = threading.Thread(target=lambda: replies.append(
        Float32Dense(group).push(np.ones(LAYOUT.total, np.float32), steps=[0], examples=4, loss=1.0)))
    pushing.start()
    assert held.wait(10), "the primary did not forward the push"
    assert primary.step == 1 and backup.step == 0
    # The primary serves on while the forward is out: a second replica's push is applied
    # (its reply waits too), and the copies' status is answered at once.
    other = ShardGroup([pair.addresses], LAYOUT, timeouts=Timeouts(request=5.0, unavailable=30.0))
    second = threading.Thread(target=lambda: replies.append(
        Float32Dense(other).push(np.ones(LAYOUT.total, np.float32), steps=[0], examples=4, loss=1.0)))
    second.start()
    eventually(lambda: primary.step == 2, 5, what="the primary applied the second push meanwhile")
    status = zmq_transport.default().link(pair.addresses[0], None)
    status.send([Header(op=COPY_STATUS.code, shard=0, layout=LAYOUT.hash, seq=9).pack()])
    assert zmq_transport.default().wait([status], 2), "COPY_STATUS waited for the forward"
    assert protocol.JsonObject.unpack(status.receive().frames[0]).value["role"] == PRIMARY
    status.close()
    pushing.join(timeout=0.5)
    assert not replies, "a push was acknowledged before the backup applied it"
    release.set()
    pushing.join(timeout=10)
    second.join(timeout=10)
    assert sorted(r.step for reply in replies for r in reply) == [1, 2]
    other.close()
    eventually(lambda: backup.step == 2, 20, what="the backup applied both")
    assert backup.step == 2
    np.testing.assert_array_equal(_params(backup), _params(primary))
    for _ in range(5):  # and every later push: each acknowledged update is on both copies
        Float32Dense(group).push(np.full(LAYOUT.total, 0.5, np.float32), steps=[0], examples=4, loss=1.0)
        assert backup.step == primary.step
        np.testing.assert_array_equal(_params(backup), _params(primary))
    group.close()


def test_a_push_resent_to_the_new_primary_is_answered_but_not_applied_again(pair: Copies) -> None:
    link = zmq_transport.default().link(pair.addresses, None)
    grad = np.full(LAYOUT.total, 0.25, np.float32)
    first = _push(link, seq=41, grad=grad)
    assert first.step == 1
    after_first = _params(pair.copy(1)).copy()
    pair.kill(0)  # the reply was lost with the primary: the replica sends the push again
    again = _push(link, seq=41, grad=grad)
    backup = pair.copy(1)
    assert backup.copies.role == PRIMARY and backup.copies.stats()["failovers"] == 1
    assert again.step == 1 and backup.step == 1
    np.testing.assert_array_equal(_params(backup), after_first)
    assert _push(link, seq=42, grad=grad).step == 2  # a new push is applied
    link.close()


def test_bfloat16_pushes_reach_every_copy_and_survive_a_failover(tmp_path: Path) -> None:
    copies = Copies(tmp_path, wire_format="bfloat16").started()
    wire, out = Bfloat16Dense(copies.group()), np.empty(LAYOUT.total, np.float32)
    codec, rng = Codec(LAYOUT.total), np.random.default_rng(6)
    expected, reference = INITIAL.copy(), Adagrad(LAYOUT.total, 0.1)
    for step in range(6):
        if step == 3:
            copies.kill(0)  # the backup takes over, with every update applied so far
        grad = rng.standard_normal(LAYOUT.total).astype(np.float32)
        reference.apply(expected, codec.widen(codec.narrow(grad, np.empty(grad.size, WIRE_DTYPE)), np.empty_like(grad)))
        [reply] = wire.push_and_pull(grad, out, steps=[step], examples=4, loss=1.0)
        assert reply.step == step + 1
        if step < 3:
            np.testing.assert_array_equal(_params(copies.copy(1)), _params(copies.copy(0)))
    assert copies.copy(1).copies.stats()["failovers"] == 1
    np.testing.assert_allclose(_params(copies.copy(1)), expected, rtol=1e-6)
    wire.group.close()
    copies.stop()


def test_a_copy_that_comes_back_catches_up_and_rejoins_as_backup(pair: Copies, tmp_path: Path) -> None:
    link = zmq_transport.default().link(pair.addresses, None)
    rng = np.random.default_rng(3)
    for seq in range(1, 4):
        _push(link, seq=seq, grad=rng.standard_normal(LAYOUT.total).astype(np.float32))
    pair.kill(1)
    for seq in range(4, 9):  # the primary drops its backup, which is gone, and goes on alone
        _push(link, seq=seq, grad=rng.standard_normal(LAYOUT.total).astype(np.float32))
    primary = pair.copy(0)
    assert primary.step == 8 and primary.copies.stats()["copies"] == 1
    returned = pair.start(1, folder=str(tmp_path / "empty"))  # a new node: nothing on disk
    eventually(lambda: pair.in_sync(0, 1), 20, what="the returned copy rejoins")
    eventually(lambda: returned.step == 8, 20, what="the returned copy loaded the state its primary sent")
    assert returned.copies.role == BACKUP
    np.testing.assert_array_equal(_params(returned), _params(primary))
    last = rng.standard_normal(LAYOUT.total).astype(np.float32)
    assert _push(link, seq=9, grad=last).step == 9
    np.testing.assert_array_equal(_params(returned), _params(primary))
    after = _params(primary).copy()
    pair.kill(0)  # the returned copy also knows what each peer sent last
    assert _push(link, seq=9, grad=last).step == 9
    assert returned.copies.role == PRIMARY and returned.step == 9
    np.testing.assert_array_equal(_params(returned), after)
    link.close()


def test_with_min_in_sync_2_a_push_waits_for_the_returning_backup_and_survives_the_primarys_loss(
        tmp_path: Path) -> None:
    """The schedule that loses updates with minInSync 1 (the backup killed, then the primary
    before the backup is back): with minInSync 2 the primary applies on but acknowledges
    nothing until the backup has caught up, so every acknowledged push is on both copies."""
    copies = Copies(tmp_path, min_in_sync=2).started()
    link = zmq_transport.default().link(copies.addresses, None)
    rng = np.random.default_rng(8)
    assert _push(link, seq=1, grad=rng.standard_normal(LAYOUT.total).astype(np.float32)).step == 1
    copies.kill(1)
    primary = copies.copy(0)
    eventually(lambda: primary.copies.stats()["copies"] == 1, 20, what="the primary dropped its dead backup")
    replies: list[Header] = []
    pushing = threading.Thread(target=lambda: replies.append(
        _push(link, seq=2, grad=rng.standard_normal(LAYOUT.total).astype(np.float32))))
    pushing.start()
    eventually(lambda: primary.step == 2, 10, what="the primary applied the push")
    pushing.join(timeout=3 * LEASE_SECONDS)
    assert not replies, "a push was acknowledged with one copy in sync"
    returned = copies.start(1, folder=str(tmp_path / "empty"))  # nothing on disk: it catches up from the primary
    pushing.join(timeout=30)
    assert [r.step for r in replies] == [2] and returned.step == 2
    after = _params(primary).copy()
    copies.kill(0)
    eventually(lambda: returned.copies.role == PRIMARY, 20, what="the returned copy took over")
    assert returned.step == 2
    np.testing.assert_array_equal(_params(returned), after)
    copies.start(0, folder=str(tmp_path / "empty-0"))  # alone it acknowledges nothing, until a copy is back
    assert _push(link, seq=3, grad=rng.standard_normal(LAYOUT.total).astype(np.float32)).step == 3
    link.close()
    copies.stop()


def test_with_min_in_sync_2_the_acknowledged_survive_the_backup_then_the_primary_dying(tmp_path: Path) -> None:
    """Both copies lost one after the other, the primary once it had dropped its dead backup:
    no checkpoint was due (an hour apart), yet the restarted copies hold every acknowledged
    push, because the primary saved one before it went on without acknowledging; and the
    push it applied without acknowledging, sent again, is answered and not applied twice."""
    copies = Copies(tmp_path, min_in_sync=2).started()
    link = zmq_transport.default().link(copies.addresses, None)
    rng = np.random.default_rng(9)
    for seq in (1, 2, 3):
        assert _push(link, seq=seq, grad=rng.standard_normal(LAYOUT.total).astype(np.float32)).step == seq
    acknowledged = _params(copies.copy(0)).copy()
    copies.kill(1)
    primary = copies.copy(0)
    eventually(lambda: primary.copies.stats()["copies"] == 1, 20, what="the primary dropped its dead backup")
    held = rng.standard_normal(LAYOUT.total).astype(np.float32)
    replies: list[Header] = []
    pushing = threading.Thread(target=lambda: replies.append(_push(link, seq=4, grad=held)))
    pushing.start()
    eventually(lambda: primary.step == 4, 10, what="the primary applied the held push")
    # the save comes with the first reply held for want of copies, just after the apply
    eventually(lambda: checkpoint.list_checkpoints(str(tmp_path / "copy-0")), 10,
               what="a checkpoint before going on alone")
    copies.kill(0)
    copies.start(0)
    copies.start(1)
    pushing.join(timeout=60)
    assert [r.step for r in replies] == [4]  # sent again, answered: the copy that leads had applied it
    leader = next(copies.copy(r) for r in (0, 1) if copies.copy(r).copies.role == PRIMARY)
    assert leader.step == 4 and not np.array_equal(_params(leader), acknowledged)
    link.close()
    copies.stop()


def test_a_copy_refuses_a_min_in_sync_above_its_copies(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="3 of them in sync"):
        Copies(tmp_path, min_in_sync=3).start(0)


def test_copies_of_an_encrypted_job_forward_and_fail_over_over_aes_gcm_sessions(tmp_path: Path) -> None:
    """The replica's link holds a session with each copy it uses, the primary one with each
    backup; a copy that restarted (its sessions gone with its process) gets asked anew when
    the link comes back to it."""
    copies = Copies(tmp_path, job_keys=keys.JobKeys.generate()).started()
    wire, out = Float32Dense(copies.group()), np.empty(LAYOUT.total, np.float32)
    rng = np.random.default_rng(8)

    def push(step: int) -> None:
        [reply] = wire.push_and_pull(rng.standard_normal(LAYOUT.total).astype(np.float32), out, steps=[step],
                                     examples=4, loss=1.0)
        assert reply.step == step + 1
        assert wire.group._links[0].session is not None, "the replica's link to the copies holds no session"

    for step in range(3):
        push(step)
    [stream] = copies.copy(0).copies.chain.streams.values()
    assert stream.link.session is not None, "the primary forwards to its backup over CurveZMQ alone"
    copies.kill(0)  # copy 1 takes over; the replica's link moves to it
    push(3)
    copies.start(0)  # a new process at copy 0's address: it knows none of the sessions granted before
    eventually(lambda: copies.in_sync(1, 1), 20, what="the restarted copy 0 rejoins as copy 1's backup")
    copies.kill(1)  # the link goes back to copy 0, over the CurveZMQ socket ZeroMQ reconnected
    for step in range(4, 7):
        push(step)
    assert copies.copy(0).copies.role == PRIMARY and copies.copy(0).step == 7
    np.testing.assert_array_equal(out, _params(copies.copy(0)))
    wire.group.close()
    copies.stop()


def test_a_copy_that_is_not_the_primary_refuses_clients(pair: Copies) -> None:
    group = ShardGroup([pair.addresses[1]], LAYOUT, timeouts=Timeouts(request=1.0, unavailable=5.0))
    with pytest.raises(errors.ShardUnavailable):  # refused every time, then given up
        Float32Dense(group).pull(np.empty(LAYOUT.total, np.float32))
    assert pair.copy(1).copies.role == BACKUP  # its primary answers: no takeover
    group.close()


def test_copies_starting_together_elect_the_one_with_the_newest_state(tmp_path: Path) -> None:
    copies = Copies(tmp_path)
    copies.start(0)
    copies.start(1)
    eventually(lambda: copies.in_sync(0, 1), 20, what="copy 0 leads")
    group = copies.group()
    for _ in range(3):
        Float32Dense(group).push(np.ones(LAYOUT.total, np.float32), steps=[0], examples=4, loss=1.0)
    group.close()
    copies.kill(0)
    copies.kill(1)  # both checkpoint at step 3; now copy 0 loses its checkpoints
    for path in (tmp_path / "copy-0").iterdir():
        path.unlink()
    copies.start(0)
    copies.start(1)
    eventually(lambda: copies.in_sync(1, 1), 20, what="copy 1, which has step 3, leads")
    assert copies.copy(1).step == 3
    # The primary counts copy 0 in its chain once it sent the state; copy 0 loads it a moment later.
    eventually(lambda: copies.copy(0).step == 3, 20, what="copy 0 caught up from copy 1")
    copies.stop()


def test_sparse_rows_reach_every_copy_and_survive_a_failover(tmp_path: Path) -> None:
    """Replication is below the plugins: a sparse push reaches the backup as a dense one does."""
    def rows(shard: Shard) -> None:
        shard.attach(SparseRows(shard, dim=4, learning_rate=0.1, seed=5))

    copies = Copies(tmp_path, attach=rows).started()
    client = RowClient(copies.group(), dim=4)
    keys = np.arange(0, 4000, 7, dtype=np.int64)
    rng = np.random.default_rng(2)
    for _ in range(3):
        client.push(keys, rng.standard_normal((keys.size, 4)).astype(np.float32))
    table = {rank: copies.copy(rank).plugin(SparseRows).checkpoint_state()[0] for rank in (0, 1)}
    assert table[0].keys() == table[1].keys()
    for name in table[0]:
        np.testing.assert_array_equal(table[0][name], table[1][name], err_msg=name)
    before, _ = client.pull(keys)
    copies.kill(0)
    after, _ = client.pull(keys)  # from copy 1, now the primary
    assert copies.copy(1).copies.role == PRIMARY
    np.testing.assert_array_equal(after, before)
    copies.stop()



def test_a_copy_catching_up_gets_every_row_of_a_primary_whose_row_checkpoints_are_incremental(
        tmp_path: Path) -> None:
    """Beyond full_write_bytes the primary's checkpoints name row files on its own disk; a
    copy catching up on another node gets the rows themselves, and writes its own base."""
    def rows(shard: Shard) -> None:
        shard.attach(SparseRows(shard, dim=4, learning_rate=0.1, seed=5, full_write_bytes=50 * (4 + 5) * 4))

    copies = Copies(tmp_path, attach=rows).started()
    client, rng = RowClient(copies.group(), dim=4), np.random.default_rng(4)
    link = zmq_transport.default().link(copies.addresses, None)
    copies.kill(1)
    primary = copies.copy(0)
    for row_keys in (np.arange(0, 1000, 2), np.arange(1000, 1200, 2)):  # a base of 500 rows, a delta of 100
        row_keys = row_keys.astype(np.int64)
        client.push(row_keys, rng.standard_normal((row_keys.size, 4)).astype(np.float32))
        _push(link, seq=primary.step + 1, grad=rng.standard_normal(LAYOUT.total).astype(np.float32))  # a step
        primary.checkpoint_now()
    chain = checkpoint.read_meta(checkpoint.list_checkpoints(str(tmp_path / "copy-0"))[0])[rowcheckpoint.CHAIN]
    assert [entry["file"].split("-")[0] for entry in chain] == ["base", "delta"]
    returned = copies.start(1, folder=str(tmp_path / "empty"))  # a new node: nothing on disk
    eventually(lambda: copies.in_sync(0, 1), 20, what="the returned copy rejoins")
    eventually(lambda: returned.step == primary.step, 20, what="the returned copy loaded the state its primary sent")
    keys = np.arange(0, 1200, 2, dtype=np.int64)
    before, _ = client.pull(keys)
    table = {rank: copies.copy(rank).plugin(SparseRows).saved.whole()[0] for rank in (0, 1)}
    assert table[1]["sparse.accumulators"].size == 600
    for name in table[0]:
        np.testing.assert_array_equal(table[0][name], table[1][name], err_msg=name)
    _push(link, seq=primary.step + 1, grad=rng.standard_normal(LAYOUT.total).astype(np.float32))
    returned.checkpoint_now()  # its own checkpoints stand on files in its own folder
    chain = checkpoint.read_meta(checkpoint.list_checkpoints(str(tmp_path / "empty"))[0])[rowcheckpoint.CHAIN]
    assert [entry["rows"] for entry in chain] == [600]
    assert (tmp_path / "empty" / rowcheckpoint.FOLDER / chain[0]["file"]).is_file()
    copies.kill(0)
    after, _ = client.pull(keys)  # from copy 1, now the primary
    np.testing.assert_array_equal(after, before)
    link.close()
    copies.stop()


def test_a_garbled_forward_is_refused_and_the_backup_keeps_serving(pair: Copies) -> None:
    backup = pair.copy(1)
    link = zmq_transport.default().link(pair.addresses[1], None)
    head = Header(op=forwarding.REPLICATE.code, shard=0, layout=LAYOUT.hash, seq=1).pack()
    push = Header(op=dense.PUSH.code, shard=0, layout=LAYOUT.hash, seq=1, count=LAYOUT.total).pack()
    for envelope in (b"not json", b'{"view": "2", "peer": "00"}', b'{"view": 2, "peer": "zz", "user": null}'):
        link.send([head, envelope, push, UPDATE, np.ones(LAYOUT.total, np.float32).tobytes()])
        assert zmq_transport.default().wait([link], 10), "no answer"
        answer = protocol.unpack_header(link.receive().header)
        assert answer.status == Status.ERROR and answer.error == protocol.ErrorCode.MALFORMED
    assert backup.step == 0 and backup.copies.role == BACKUP
    link.close()


@pytest.mark.parametrize("payload", [b"[1, 2]", b'{"role": "primary", "view": [1], "step": 3}', b"not json"])
def test_a_garbled_copy_status_answer_is_refused_and_the_watch_asks_again(payload: bytes) -> None:
    from distbelief.runtime.shard.copies.watch import Watch
    from distbelief.runtime.transport.memory_transport import MemoryTransport

    watch = Watch(shard=0, layout=1, addresses={1: "inproc://nobody"}, security=None, transport_=MemoryTransport())
    header = memoryview(Header(op=30, shard=0, layout=1, seq=watch._seq, status=Status.OK).pack())
    with pytest.raises((errors.ProtocolError, TypeError)):
        watch._take(1, interface.Received(header=header, frames=[memoryview(payload)]))
    assert 1 not in watch.latest  # nothing believed from it
    watch._round = lambda: watch._take(1, interface.Received(header=header, frames=[memoryview(payload)]))
    watch.start()
    time.sleep(0.1)
    assert watch._thread.is_alive()  # the round's error is logged; the watch goes on
    watch.close()


def _push_for(group: ShardGroup, seconds: float) -> int:
    """Push ones for `seconds`; how many pushes the shard acknowledged."""
    acked, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        Float32Dense(group).push(np.ones(LAYOUT.total, np.float32), steps=[0], examples=4, loss=1.0)
        acked += 1
    return acked


def test_a_backup_stalled_in_a_forward_costs_no_acknowledged_update(tmp_path: Path) -> None:
    """Issue 31's reproduction: copy 2's REPLICATE handler hangs 7 s while a replica pushes for
    9 s. The primary goes on serving, takes copy 2 out of the in-sync set once it is slow, and
    every push it acknowledged is in the final state; copy 2 then catches up again."""
    copies = Copies(tmp_path, count=3)
    for rank in range(3):
        copies.start(rank)
    eventually(lambda: copies.in_sync(0, 2), 20, what="copy 0 leads with two backups")
    stalled = copies.copy(2)
    forwarded, hung = stalled.raw_ops[forwarding.REPLICATE.code], threading.Event()

    def hang(header: Header, incoming: interface.Incoming) -> list:
        if not hung.is_set():
            hung.set()
            time.sleep(7)
        return forwarded(header, incoming)

    stalled.raw_ops[forwarding.REPLICATE.code] = hang
    group = ShardGroup([copies.addresses], LAYOUT, timeouts=Timeouts(request=2.0, unavailable=30.0))
    acked = _push_for(group, 9.0)
    group.close()
    assert hung.is_set()
    primary = copies.copy(0)
    assert primary.copies.role == PRIMARY, "the primary stalled by its backup must not be replaced"
    assert primary.step == acked
    eventually(lambda: copies.in_sync(0, 2), 30, what="copy 2 catches up and rejoins")
    eventually(lambda: all(copies.copy(r).step == acked for r in range(3)), 20, what="every copy holds every push")
    for rank in (1, 2):
        np.testing.assert_array_equal(_params(copies.copy(rank)), _params(primary))
    copies.stop()


def test_a_primary_stalled_in_a_request_is_slow_not_dead(tmp_path: Path) -> None:
    """The primary's serving thread hangs 4 s (more than its lease): its lease is renewed by a
    thread of its own, so no backup takes over, and nothing is lost."""
    copies = Copies(tmp_path).started()
    primary = copies.copy(0)
    pull, hung = primary._handlers[dense.PULL.code], threading.Event()

    def hang(message: protocol.Message) -> object:
        if not hung.is_set():
            hung.set()
            time.sleep(4)
        return pull(message)

    primary._handlers[dense.PULL.code] = hang
    group = copies.group()
    Float32Dense(group).pull(np.empty(LAYOUT.total, np.float32))
    acked = _push_for(group, 2.0)
    group.close()
    assert hung.is_set() and primary.copies.role == PRIMARY and copies.copy(1).copies.role == BACKUP
    assert primary.copies.stats()["failovers"] == 0
    assert primary.step == copies.copy(1).step == acked
    copies.stop()


@pytest.mark.parametrize("encrypted", [False, True], ids=["keyless", "sessions"])
def test_a_copy_catching_up_while_pushes_go_on_ends_with_the_primarys_state_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, encrypted: bool) -> None:
    """The state goes over in many parts, one at a time, while sparse and dense pushes keep
    coming (some creating rows, some only counted for admission): the copy applies them from
    the transfer's start and writes each part where it comes, and ends with the primary's
    every row, admission counter and parameter. Encrypted, the stream's first messages wait
    for its session's grant and then go sealed, in order."""
    from distbelief.runtime.params.rows import rowparts

    monkeypatch.setattr(forwarding, "PARTS_WINDOW_BYTES", 1)  # a part goes only once the previous is acknowledged
    monkeypatch.setattr(rowparts, "PART_BYTES", 4096)          # 256 parts of rows
    monkeypatch.setattr(dense, "PART_VALUES", 4)               # 9 parts of the dense slice
    caplog.set_level(logging.INFO, logger="distbelief.runtime.shard.copies")

    def rows(shard: Shard) -> None:
        shard.attach(SparseRows(shard, dim=4, learning_rate=0.1, seed=5, admit_after=2))

    copies = Copies(tmp_path, attach=rows, job_keys=keys.JobKeys.generate() if encrypted else None).started()
    copies.kill(1)
    client, rng = RowClient(copies.group(), dim=4), np.random.default_rng(8)
    wire = Float32Dense(client.group)

    def push_once() -> None:
        row_keys = rng.choice(60000, size=300, replace=False).astype(np.int64)
        client.push(row_keys, rng.standard_normal((row_keys.size, 4)).astype(np.float32))
        wire.push(rng.standard_normal(LAYOUT.total).astype(np.float32), steps=[0], examples=4, loss=1.0)

    for _ in range(60):  # thousands of rows admitted, more only counted, before the copy comes
        push_once()
    pushing, stop = threading.Thread(target=lambda: [push_once() for _ in iter(stop.is_set, True)]), threading.Event()
    pushing.start()
    joined = copies.start(1, folder=str(tmp_path / "empty"))
    eventually(lambda: copies.in_sync(0, 1), 60, what="the copy caught up while pushes went on")
    if encrypted:
        assert all(s.link.session is not None for s in copies.copy(0).copies.chain.streams.values())
    time.sleep(0.5)
    stop.set()
    pushing.join(timeout=30)
    primary = copies.copy(0)
    eventually(lambda: joined.step == primary.step, 20, what="the copy applied the last pushes")
    begun = re.findall(r"event=backup_joining .* step=(\d+) view=\d+ parts=(\d+)", caplog.text)[-1]
    installed = re.findall(r"event=caught_up shard=0 copy=1 view=\d+ step=(\d+)", caplog.text)[-1]
    assert int(begun[1]) > 9 + 16, "the rows went in too few parts"
    assert int(installed) > int(begun[0]), "no push came during the transfer"
    tables = [copies.copy(r).plugin(SparseRows).table for r in (0, 1)]
    state = []
    for t in tables:
        order = np.argsort(t.keys[:t.n])
        state.append({"keys": t.keys[:t.n][order], "values": t.values[:t.n][order],
                      "accumulators": t.accumulators[:t.n][order], "counters": t.counts})
    assert state[0]["keys"].size > 3000
    for name in state[0]:
        np.testing.assert_array_equal(state[1][name], state[0][name], err_msg=name)
    np.testing.assert_array_equal(_params(joined), _params(primary))
    client.group.close()
    copies.stop()


class CutOff:
    """A view store as one copy sees it: cut off (unavailable) while `cut` is set."""

    def __init__(self, store: Any) -> None:
        self.store, self.cut = store, False

    def read(self) -> Any:
        self._check()
        return self.store.read()

    def compare_and_swap(self, version: str, record: Any) -> Any:
        self._check()
        return self.store.compare_and_swap(version, record)

    def describe(self) -> str:
        return "cut off" if self.cut else self.store.describe()

    def _check(self) -> None:
        from distbelief.runtime.shard.copies.viewstore import StoreUnavailable
        if self.cut:
            raise StoreUnavailable("cut off")


def test_a_primary_cut_off_from_the_view_store_stops_acknowledging_and_its_backup_takes_over(tmp_path: Path) -> None:
    """A partition between the primary and the store alone: its lease runs out by its own
    clock, so it holds its replies; the backup sees the lease expire by its clock and takes
    the next view; a push the old primary applied is answered by the new one from its record,
    never applied twice. Back in touch, the old primary finds its lease gone and catches up."""
    copies = Copies(tmp_path)
    seen_by_0 = CutOff(copies.store)
    copies.start(0, store=seen_by_0)
    copies.start(1)
    eventually(lambda: copies.in_sync(0, 1), 20, what="copy 0 leads with copy 1 as its backup")
    old, new = copies.copy(0), copies.copy(1)
    link = zmq_transport.default().link(copies.addresses, None)
    grad = np.full(LAYOUT.total, 0.5, np.float32)
    assert _push(link, seq=1, grad=grad).step == 1
    seen_by_0.cut = True
    acknowledged, seq, cut = [], 1, time.monotonic()
    while time.monotonic() - cut < 3 * LEASE_SECONDS:
        seq += 1
        acknowledged.append(_push(link, seq=seq, grad=grad).step)
    assert acknowledged == list(range(2, seq + 1))  # each once, whichever copy answered
    assert new.copies.role == PRIMARY and new.copies.stats()["failovers"] == 1
    assert new.step == seq and old.step <= seq
    seen_by_0.cut = False
    eventually(lambda: copies.in_sync(1, 1), 20, what="the old primary stepped down and caught up")
    assert old.step == new.step == seq
    np.testing.assert_array_equal(_params(old), _params(new))
    link.close()
    copies.stop()


def _with_holds(shard: Shard) -> None:
    shard.attach(HeldGradients(shard.plugin(DenseSlice)))


def test_held_steps_reach_a_copy_catching_up_and_commit_on_it_once_the_others_are_gone(tmp_path: Path) -> None:
    """Partitioned jobs with backups: a hold and its pin are acknowledged only once every copy
    in sync has them, a copy catching up receives them with the state, and whichever copy is
    left commits the step (no step half applied across a model's shards for want of a hold)."""
    copies = Copies(tmp_path, count=3, attach=_with_holds)
    for rank in range(3):
        copies.start(rank)
    eventually(lambda: copies.in_sync(0, 2), 20, what="copy 0 leads with two backups")
    copies.kill(2)
    eventually(lambda: copies.in_sync(0, 1), 20, what="copy 2 out of the in-sync set")
    group = copies.group()
    pinned, open_ = np.full(LAYOUT.total, 0.5, np.float32), np.full(LAYOUT.total, -2.0, np.float32)
    group.request(HOLD, meta=Held(5, 7), array=[pinned], steps=[0])
    group.request(PREPARE_HELD, meta=Held(5, 7))
    group.request(HOLD, meta=Held(6, 8), array=[open_], steps=[0])
    for rank in (0, 1):  # every copy in sync holds both, the pin included
        holds = copies.copy(rank).plugin(HeldGradients).held
        assert {g: (h.token, h.pinned) for g, h in holds.items()} == {5: (7, True), 6: (8, False)}
    copies.start(2)
    eventually(lambda: copies.in_sync(0, 2), 30, what="copy 2 catches up")
    caught_up = copies.copy(2).plugin(HeldGradients).held
    assert {g: (h.token, h.pinned) for g, h in caught_up.items()} == {5: (7, True), 6: (8, False)}
    np.testing.assert_array_equal(caught_up[5].grad, pinned)
    np.testing.assert_array_equal(caught_up[6].grad, open_)
    expected = _params(copies.copy(0)).copy()
    for rank in (0, 1):  # both at once: had copy 1 taken over first, copy 2 would have to catch up again
        copies.copy(rank).stop()
    copies.kill(0)
    copies.kill(1)
    group.request(APPLY_HELD, meta=ApplyHeld(5, 7, 32, 1.0))  # to copy 2, once it took over
    survivor = copies.copy(2)
    assert survivor.copies.role == PRIMARY and survivor.step == 1
    reference = Shard(ShardSettings(shard=0, bind="inproc://reference", checkpoint_dir=str(tmp_path / "ref")),
                      LAYOUT, ShardMetrics(prom.CollectorRegistry(), 0))
    slice_ = DenseSlice(reference, expected, optimizer="adagrad", learning_rate=0.1)
    slice_.apply(Header(op=APPLY_HELD.code, shard=0, layout=LAYOUT.hash), pinned, examples=32, loss=1.0)
    np.testing.assert_array_equal(_params(survivor), slice_.params)
    group.close()
    copies.stop()


def test_a_hold_applied_or_replaced_while_a_copy_catches_up_is_skipped_in_the_transfer(tmp_path: Path) -> None:
    """The holds' parts come first and each names its step: one applied, dropped or replaced
    between the plan and its part is left as the commands since made it, on both sides."""
    settings = ShardSettings(shard=0, bind="inproc://held", checkpoint_dir=str(tmp_path))
    sender, receiver = (Shard(settings, LAYOUT, ShardMetrics(prom.CollectorRegistry(), 0)) for _ in range(2))
    holds = []
    for shard in (sender, receiver):
        shard.attach(DenseSlice(shard, INITIAL, optimizer="sgd", learning_rate=1.0))
        _with_holds(shard)
        holds.append(shard.plugin(HeldGradients))
    head = Header(op=HOLD.code, shard=0, layout=LAYOUT.hash)
    for group, value in ((1, 1.0), (2, 2.0)):
        holds[0].held[group] = HeldGradient(group * 10, head, np.full(LAYOUT.total, value, np.float32), 0.0)
    plan = json.loads(json.dumps(holds[0].transfer_plan()))  # as the wire carries it
    assert plan["first"] and plan["parts"] == 2 * plan["pieces"]
    holds[1].begin_receiving(plan)
    replaced = np.full(LAYOUT.total, 9.0, np.float32)
    for side in holds:  # a command between the plan and the parts: group 2 holds its next step
        side.held[2] = HeldGradient(21, head, replaced.copy(), 1.0)
    for part in range(plan["parts"]):
        holds[1].write_part(part, holds[0].read_part(plan, part))
    holds[1].end_receiving()
    np.testing.assert_array_equal(holds[1].held[1].grad, np.full(LAYOUT.total, 1.0, np.float32))
    np.testing.assert_array_equal(holds[1].held[2].grad, replaced)
    with pytest.raises(errors.ProtocolError, match="piece 0 of a held gradient"):
        holds[1].begin_receiving(plan)
        holds[1].write_part(0, {"grad": np.ones(3, np.float32)})


def test_a_copy_whose_catch_up_broke_off_takes_the_record_of_last_commands_of_the_checkpoint_it_goes_back_to(
        tmp_path: Path) -> None:
    """Issue 42: the transfer's begin brings the primary's record of each peer's last command;
    a copy that goes back to its checkpoint when the transfer breaks off must take the
    checkpoint's record too, or it answers a resend of a push its state does not hold (lost)."""
    settings = ShardSettings(shard=0, bind="inproc://aborted", checkpoint_dir=str(tmp_path))
    primary, behind = (Shard(settings, LAYOUT, ShardMetrics(prom.CollectorRegistry(), 0)) for _ in range(2))
    for shard in (primary, behind):
        shard.attach(DenseSlice(shard, INITIAL, optimizer="sgd", learning_rate=1.0))
    peer = (None, b"replica")
    behind.last_commands.remember(peer, 1, dense.PUSH.code, [b"reply to push 1"])
    behind.checkpoint_now()
    primary.step = 2
    primary.last_commands.remember(peer, 2, dense.PUSH.code, [b"reply to push 2"])
    receiver = transfer.Receiver(behind, view=1, stream="s")
    fields, arrays = transfer.Sender(primary).begin()
    receiver.begin(json.loads(json.dumps(fields)), [memoryview(a) for a in arrays])
    assert behind.last_commands.get(peer)[0] == 2
    assert receiver.abort()  # the primary died mid-transfer
    assert (behind.step, behind.last_commands.get(peer)[:2]) == (0, (1, dense.PUSH.code))


def test_a_deleted_view_record_never_brings_a_view_number_back(tmp_path: Path) -> None:
    """The record gone (a Lease deleted by hand), the copies claim a view above every view
    used before, from the live copies' views and, once every copy restarted, from the epoch
    each keeps beside its checkpoints (copies/epoch.py); pushes go on without a loss."""
    copies = Copies(tmp_path).started()
    link = zmq_transport.default().link(copies.addresses, None)
    grad = np.full(LAYOUT.total, 0.25, np.float32)
    assert _push(link, seq=1, grad=grad).step == 1
    copies.kill(0)
    assert _push(link, seq=2, grad=grad).step == 2                  # copy 1 took over: view 2
    copies.start(0)
    eventually(lambda: copies.in_sync(1, 1), 20, what="copy 0 back as copy 1's backup")
    used = copies.copy(1).copies.view
    assert used >= 2

    Path(copies.store.path).unlink()
    record = eventually(lambda: _led_anew(copies), 60, what="a primary of a new record with its backup")
    assert record.view > used, f"view {record.view} after views up to {used}"
    assert _push(link, seq=3, grad=grad).step == 3

    copies.stop()
    Path(copies.store.path).unlink()                 # nothing live remembers a view now but the volumes
    again = record.view
    copies.start(0)
    copies.start(1)
    record = eventually(lambda: _led_anew(copies), 60, what="a primary after the restart, with its backup")
    assert record.view > again, f"view {record.view} after views up to {again}"
    assert _push(link, seq=4, grad=grad).step == 4
    link.close()
    copies.stop()


def _led_anew(copies: Copies) -> Any:
    """The record, once one exists again and its primary leads with the other copy in sync."""
    record, _ = copies.store.read()
    return record if record is not None and copies.in_sync(record.primary, 1) else None
