"""A shard's journal (spec.parameterServers.journal) on loopback: a reply leaves only once
what it answers is on disk, a shard that lost the state since its checkpoint gets it back
bit for bit from the journal, a resend after that is answered and not applied twice, a torn
tail is cut and kept aside, and the files stay bounded as checkpoints land."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import prometheus_client as prom
import pytest

from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.params import dense
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.shard import checkpoint, journal
from distbelief.runtime.shard.core import Shard, ShardSettings
from distbelief.runtime.shard.journal import Journal
from distbelief.runtime.transport import fanout, interface, zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.protocol import Header

from support.ports import free_port
from support.waiting import eventually

LAYOUT = Layout.of([("w", (6, 5)), ("b", (5,))], shards=1)
INITIAL = np.linspace(-1, 1, LAYOUT.total, dtype=np.float32)
UPDATE = dense.Update(examples=4, loss=1.0).pack()


def journaled(settings: ShardSettings) -> tuple[Shard, Journal]:
    """Shard 0 (an Adagrad slice) with its journal, restored and replayed, not serving."""
    shard = Shard(settings, LAYOUT, ShardMetrics(prom.CollectorRegistry(), 0))
    shard.attach(DenseSlice(shard, INITIAL, optimizer="adagrad", learning_rate=0.1))
    journal_ = Journal(shard)
    shard.attach(journal_)
    shard.serve_copies(journal_)
    shard.restore()
    journal_.replay()
    return shard, journal_


class JournaledShard:
    """Shard 0 with a journal, serving in a thread at a fixed loopback address."""

    def __init__(self, folder: Path, checkpoint_every: float = 3600) -> None:
        self.folder, self.checkpoint_every = folder, checkpoint_every
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.shard: Shard | None = None
        self.thread: threading.Thread | None = None
        self.journal: Journal | None = None

    def start(self) -> "JournaledShard":
        shard, self.journal = journaled(ShardSettings(shard=0, bind=self.address, checkpoint_every=self.checkpoint_every,
                                                      checkpoint_dir=str(self.folder), checkpoint_keep=5))
        self.thread = threading.Thread(target=shard.serve, daemon=True)
        self.thread.start()
        assert shard.ready.wait(10)
        self.shard = shard
        return self

    def stop(self) -> None:
        assert self.shard is not None and self.thread is not None
        self.shard.stop()
        self.thread.join(timeout=10)
        self.shard = None

    def state(self) -> dict[str, np.ndarray]:
        assert self.shard is not None
        arrays, _ = self.shard.plugin(DenseSlice).checkpoint_state()
        return {name: array.copy() for name, array in arrays.items()}

    def group(self) -> ShardGroup:
        return ShardGroup([[self.address]], LAYOUT, timeouts=Timeouts(request=2.0, unavailable=30.0))


def push(link: interface.Link, seq: int, grad: np.ndarray) -> Header:
    """One push from a fixed peer and worker, as a replica sends it (again, on a resend)."""
    request = [Header(op=dense.PUSH.code, shard=0, layout=LAYOUT.hash, seq=seq, worker=7, count=grad.size).pack(),
               UPDATE, grad.tobytes()]
    taken: list[Header] = []

    def accept(_: int, received: interface.Received) -> bool:
        header = protocol.unpack_header(received.header)
        if header.seq != seq:
            return False
        taken.append(header)
        return True

    fanout.exchange(zmq_transport.default(), fanout.Exchange([link], [request], fanout.RetryPolicy(attempt=1.0,
                    give_up=30.0), ["shard 0"]), accept=accept, stop=threading.Event())
    return taken[0]


def forget_checkpoints_after(folder: Path, step: int) -> None:
    """What a SIGKILL leaves: no checkpoint of the state since `step` (the journal is on disk)."""
    for path in checkpoint.list_checkpoints(str(folder)):
        if checkpoint.load(path).step > step:
            os.remove(path)


def gradients(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(LAYOUT.total).astype(np.float32) for _ in range(count)]


def test_the_state_since_the_checkpoint_comes_back_bit_for_bit_and_a_resend_is_not_applied_twice(tmp_path: Path) -> None:
    server = JournaledShard(tmp_path).start()
    link = zmq_transport.default().link([server.address], None)
    grads = gradients(12, seed=3)
    for seq in range(1, 6):
        assert push(link, seq, grads[seq - 1]).step == seq
    server.stop()                                   # a checkpoint of step 5
    server.start()
    for seq in range(6, 13):
        assert push(link, seq, grads[seq - 1]).step == seq
    before = server.state()
    server.stop()
    forget_checkpoints_after(tmp_path, 5)

    server.start()

    assert server.journal is not None and server.journal.replayed == 7
    after = server.state()
    assert after.keys() == before.keys() and all(np.array_equal(after[k], before[k]) for k in before)
    assert push(link, 12, grads[11]).step == 12     # the last push sent again: answered, not applied
    assert all(np.array_equal(server.state()[k], before[k]) for k in before)
    assert push(link, 13, grads[0]).step == 13
    link.close()
    server.stop()


def test_a_reply_waits_until_the_command_is_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flushing, release = threading.Event(), threading.Event()
    real = os.fdatasync

    def slow_disk(descriptor: int) -> None:
        flushing.set()
        release.wait(30)
        real(descriptor)

    server = JournaledShard(tmp_path).start()
    monkeypatch.setattr(journal.os, "fdatasync", slow_disk)
    group = server.group()
    replies: list = []
    pushing = threading.Thread(target=lambda: replies.append(
        Float32Dense(group).push(np.ones(LAYOUT.total, np.float32), steps=[0], examples=4, loss=1.0)))
    pushing.start()
    assert flushing.wait(10), "the shard never flushed its journal"
    pushing.join(timeout=1.0)
    assert pushing.is_alive() and not replies, "the reply left before the journal was on disk"
    assert server.shard is not None and server.shard.step == 1       # applied, held
    release.set()
    pushing.join(timeout=30)
    assert replies, "the reply never left once the journal was on disk"
    group.close()
    server.stop()


def test_a_torn_tail_is_cut_and_kept_aside_and_the_journal_goes_on_from_a_record(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = JournaledShard(tmp_path).start()
    link = zmq_transport.default().link([server.address], None)
    grads = gradients(6, seed=5)
    for seq in range(1, 5):
        push(link, seq, grads[seq - 1])
    at_four = server.state()
    server.stop()
    forget_checkpoints_after(tmp_path, 0)
    (last,) = sorted((tmp_path / journal.FOLDER).glob("*.log"))
    torn = journal.RECORD.pack(journal.MAGIC, 10_000, 0) + b"half a record"
    with open(last, "ab") as file:
        file.write(torn)

    server.start()

    assert server.journal is not None and server.journal.replayed == 4
    assert all(np.array_equal(server.state()[k], at_four[k]) for k in at_four)
    assert Path(f"{last}.rejected").read_bytes() == torn
    assert "event=journal_tail_cut" in caplog.text and "event=journal_replay_stopped" not in caplog.text
    push(link, 5, grads[4])
    at_five = server.state()
    server.stop()
    forget_checkpoints_after(tmp_path, 0)
    server.start()                                  # over the cut file, on to the one after it
    assert server.journal.replayed == 5
    assert all(np.array_equal(server.state()[k], at_five[k]) for k in at_five)
    link.close()
    server.stop()


def test_a_damaged_record_before_the_last_file_stops_the_replay_and_sets_the_rest_aside(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = JournaledShard(tmp_path).start()
    link = zmq_transport.default().link([server.address], None)
    grads = gradients(5, seed=13)
    for seq in (1, 2, 3):
        push(link, seq, grads[seq - 1])
    server.stop()                                   # a checkpoint: the next push opens a second file
    server.start()
    for seq in (4, 5):
        push(link, seq, grads[seq - 1])
    server.stop()
    forget_checkpoints_after(tmp_path, 0)
    first, second = sorted((tmp_path / journal.FOLDER).glob("*.log"))
    damaged = bytearray(first.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF             # inside the second of its three records
    first.write_bytes(bytes(damaged))

    server.start()

    assert server.journal is not None and server.journal.replayed == 1 and server.shard.step == 1
    assert "event=journal_replay_stopped" in caplog.text
    assert not second.exists() and list(second.parent.glob(f"{second.name}.unreplayed-*"))
    assert Path(f"{first}.rejected").exists()
    link.close()
    server.stop()


def test_files_two_landed_checkpoints_hold_whole_are_removed(tmp_path: Path) -> None:
    server = JournaledShard(tmp_path, checkpoint_every=0).start()     # a checkpoint after every push
    link = zmq_transport.default().link([server.address], None)
    for seq, grad in enumerate(gradients(20, seed=7), start=1):
        push(link, seq, grad)
    eventually(lambda: len(list((tmp_path / journal.FOLDER).glob("*.log"))) <= 3, 10,
               what="the journal's covered files removed")
    link.close()
    server.stop()


def test_a_state_gone_back_to_a_checkpoint_sets_the_journal_after_it_aside(tmp_path: Path) -> None:
    """A shard whose state went back to a checkpoint while serving (its recovery from a
    non-finite state) undid the commands after it: a restart must not replay them, only
    what it applied since."""
    settings = ShardSettings(shard=0, bind="tcp://127.0.0.1:0", checkpoint_dir=str(tmp_path), checkpoint_every=3600)

    def apply(shard: Shard, journal_: Journal, seq: int, grad: np.ndarray) -> None:
        frames = [Header(op=dense.PUSH.code, shard=0, layout=LAYOUT.hash, seq=seq, worker=7, count=grad.size).pack(),
                  UPDATE, grad.tobytes()]
        shard.answer(protocol.unpack_header(frames[0]), interface.Incoming(peer=b"replica", user=None,
                                                                           frames=[memoryview(f) for f in frames]))
        journal_.tick()

    grads = gradients(6, seed=11)
    shard, journal_ = journaled(settings)
    for seq in (1, 2, 3):
        apply(shard, journal_, seq, grads[seq - 1])
    shard.checkpoint_now()
    (saved,) = checkpoint.list_checkpoints(str(tmp_path))
    for seq in (4, 5):
        apply(shard, journal_, seq, grads[seq - 1])
    shard.load(checkpoint.load(saved))              # back to step 3: pushes 4 and 5 undone
    assert list((tmp_path / journal.FOLDER).glob("*.undone-*"))
    apply(shard, journal_, 6, grads[5])
    expected = {name: array.copy() for name, array in shard.plugin(DenseSlice).checkpoint_state()[0].items()}
    assert shard.step == 4

    again, journal_again = journaled(settings)

    assert journal_again.replayed == 1 and again.step == 4
    state = again.plugin(DenseSlice).checkpoint_state()[0]
    assert all(np.array_equal(state[k], expected[k]) for k in expected)

