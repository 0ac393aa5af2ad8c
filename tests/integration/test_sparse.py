"""Sparse embedding rows on live shards: pull, push, resends, ownership, hostile input,
checkpoints, through the real ZeroMQ protocol."""

from __future__ import annotations

import random
import struct
from pathlib import Path
from typing import Iterator

import numpy as np
import prometheus_client as prom
import pytest
import zmq

from distbelief.runtime import errors, jobspec
from distbelief.runtime.algorithms.downpour.sparse_worker import SparseWorker, held_out_inputs
from distbelief.runtime.model import data, models
from distbelief.runtime.model.embedding import EmbeddingModel
from distbelief.runtime.observe.metrics import WorkerMetrics
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.params.rows import rowcheckpoint, sparse
from distbelief.runtime.params.rows.row_client import RowClient
from distbelief.runtime.params.rows.rowtable import EPSILON, initial_rows
from distbelief.runtime.params.rows.sparse import KeyCounts, Keys, SparseRows
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.protocol import Header, Status
from distbelief.runtime.wire.rowkeys import owner_of

from support.shards import LiveShards, start_row_shards, start_shards

DIM, SEED, LR = 4, 11, 0.5
LAYOUT = Layout.of([("w", (10, 7)), ("b", (7,))], shards=2)


def _start(folder: Path, **options: object) -> LiveShards:
    return start_row_shards(folder, LAYOUT, dim=DIM, learning_rate=LR, seed=SEED, max_gradient_norm=100.0, **options)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveShards]:
    shards = _start(tmp_path)
    yield shards
    shards.stop()


def _tables(live: LiveShards) -> list:
    return [s.plugin(SparseRows).table for s in live.shards]


def _pushed(keys: np.ndarray) -> KeyCounts:
    return KeyCounts(keys, np.ones(keys.size, np.int64))


def _keys(n: int, seed: int = 0) -> np.ndarray:
    return np.unique(np.random.default_rng(seed).integers(0, 2**63 - 1, n, dtype=np.int64))


def test_a_pull_of_new_keys_returns_initial_rows_without_creating_them(live: LiveShards) -> None:
    keys = _keys(500)
    rows, replies = RowClient(live.group(), DIM).pull(keys)
    np.testing.assert_array_equal(rows, initial_rows(keys, DIM, SEED))
    assert [r.header.status for r in replies] == [Status.OK, Status.OK]
    assert [t.n for t in _tables(live)] == [0, 0]


def test_pushed_rows_land_on_their_owners_and_read_back_updated(live: LiveShards) -> None:
    keys = _keys(300)
    client = RowClient(live.group(), DIM)
    grads = np.random.default_rng(1).standard_normal((keys.size, DIM)).astype(np.float32)
    client.push(keys, grads)
    owners = owner_of(keys, 2)
    assert [t.n for t in _tables(live)] == [int((owners == 0).sum()), int((owners == 1).sum())]
    assert 0 < _tables(live)[0].n < keys.size  # both shards own some
    acc = (grads.astype(np.float64) ** 2).mean(axis=1)
    expected = initial_rows(keys, DIM, SEED) - LR * grads / (np.sqrt(acc)[:, None] + EPSILON)
    rows, _ = client.pull(keys)
    np.testing.assert_allclose(rows, expected, rtol=1e-5, atol=1e-6)


def test_a_sparse_push_does_not_advance_the_step(live: LiveShards) -> None:
    client = RowClient(live.group(), DIM)
    replies = client.push(_keys(10), np.ones((10, DIM), np.float32))
    assert [r.header.step for r in replies] == [0, 0]


def test_a_shard_without_keys_in_a_request_answers_with_no_rows(live: LiveShards) -> None:
    keys = _keys(200)
    one_owner = keys[owner_of(keys, 2) == 1][:5]
    rows, _ = RowClient(live.group(), DIM).pull(one_owner)
    np.testing.assert_array_equal(rows, initial_rows(one_owner, DIM, SEED))
    RowClient(live.group(), DIM).push(one_owner, np.ones((5, DIM), np.float32))
    assert [t.n for t in _tables(live)] == [0, 5]


def test_a_resent_sparse_push_is_applied_once(live: LiveShards) -> None:
    keys = _keys(200)
    mine = keys[owner_of(keys, 2) == 0][:8]
    frames = [Header(op=sparse.SPARSE_PUSH.code, shard=0, layout=LAYOUT.hash, seq=5, worker=9,
                     count=mine.size * DIM).pack(), _pushed(mine).pack(), np.ones(mine.size * DIM, np.float32).tobytes()]
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(live.addresses[0])
    for _ in range(3):
        socket.send_multipart(frames)
        assert socket.poll(5000)
        assert protocol.unpack_header(socket.recv_multipart()[0]).status == Status.OK
    socket.close(linger=0)
    table = _tables(live)[0]
    np.testing.assert_allclose(table.accumulators[table.lookup(mine)], 1.0)  # one push of ones


def test_keys_sent_to_a_shard_that_does_not_own_them_are_refused(live: LiveShards) -> None:
    keys = _keys(200)
    theirs = keys[owner_of(keys, 2) == 1][:4]
    group = live.group()
    with pytest.raises(errors.ShardRefused, match="another shard owns"):
        group.request(sparse.SPARSE_PUSH, meta=[_pushed(theirs), _pushed(theirs[:0])],
                      array=[np.ones(theirs.size * DIM, np.float32), np.zeros(0, np.float32)])
    assert [t.n for t in _tables(live)] == [0, 0]


def _hostile_sparse(rng: random.Random, mine: np.ndarray) -> list[list[bytes]]:
    """Malformed key lists and row arrays; none may change the table."""
    def push(keys_frame: bytes, values: np.ndarray | bytes, count: int | None = None) -> list[bytes]:
        raw = values if isinstance(values, bytes) else values.astype(np.float32).tobytes()
        n = len(raw) // 4 if count is None else count
        return [Header(op=sparse.SPARSE_PUSH.code, shard=0, layout=LAYOUT.hash, seq=rng.getrandbits(30),
                       worker=rng.getrandbits(30), count=n).pack(), keys_frame, raw]

    good, ones = _pushed(mine).pack(), np.ones(mine.size * DIM)
    duplicate = _pushed(np.r_[mine, mine[:1]]).pack()
    negative = _pushed(np.r_[mine[:-1], np.int64(-5)]).pack()
    pull_good, pull_duplicate = Keys(mine).pack(), Keys(np.r_[mine, mine[:1]]).pack()
    never_seen = KeyCounts(mine, np.r_[np.ones(mine.size - 1, np.int64), 0]).pack()
    kinds = [
        lambda: push(good, np.full(mine.size * DIM, np.nan)),
        lambda: push(good, np.r_[ones[:-1], np.inf]),
        lambda: push(good, ones[:-DIM]),                          # fewer rows than keys
        lambda: push(good, ones, count=ones.size + 1),            # header count disagrees
        lambda: push(good[:-3], ones),                            # truncated key list
        lambda: push(Keys(mine).pack(), ones),                    # keys without their occurrence counts
        lambda: push(never_seen, ones),                           # a pushed key that occurred 0 times
        lambda: push(good + b"\0" * 8, ones),                     # more bytes than its count
        lambda: push(struct.pack("<I", sparse.MAX_KEYS + 1), ones),
        lambda: push(struct.pack("<I", 2**32 - 1) + good[4:], ones),
        lambda: push(b"", ones),
        lambda: push(duplicate, np.ones((mine.size + 1) * DIM)),
        lambda: push(negative, ones),
        lambda: push(good, ones.astype(np.float64).tobytes()),    # float64 rows
        lambda: [Header(op=sparse.SPARSE_PULL.code, shard=0, layout=LAYOUT.hash).pack(), pull_duplicate],
        lambda: [Header(op=sparse.SPARSE_PULL.code, shard=0, layout=LAYOUT.hash, count=4).pack(), pull_good],
        lambda: [Header(op=sparse.SPARSE_PULL.code, shard=0, layout=LAYOUT.hash).pack(), pull_good, pull_good],
        lambda: [Header(op=sparse.SPARSE_PULL.code, shard=0, layout=LAYOUT.hash).pack(),
                 rng.randbytes(rng.randint(0, 100))],
    ]
    return [rng.choice(kinds)() for _ in range(400)]


def test_hostile_sparse_messages_never_change_the_table_and_the_shard_keeps_serving(live: LiveShards) -> None:
    keys = _keys(300)
    mine = keys[owner_of(keys, 2) == 0][:6]
    client = RowClient(live.group(), DIM)
    client.push(mine, np.ones((mine.size, DIM), np.float32))
    table = _tables(live)[0]
    before = (table.n, table.values[: table.n].copy(), table.accumulators[: table.n].copy())
    messages = _hostile_sparse(random.Random(3), mine)
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(live.addresses[0])
    for frames in messages:  # one at a time: a flood would outrun the shard's reply queue
        socket.send_multipart(frames)
        assert socket.poll(5000), "a hostile message got no reply"
        assert protocol.unpack_header(socket.recv_multipart()[0]).status == Status.ERROR
    socket.close(linger=0)
    assert live.shards[0].metrics.rejected._value.get() == len(messages)
    assert table.n == before[0]
    np.testing.assert_array_equal(table.values[: table.n], before[1])
    np.testing.assert_array_equal(table.accumulators[: table.n], before[2])
    rows, _ = client.pull(mine)
    np.testing.assert_array_equal(rows, before[1][table.lookup(mine)])


def test_a_restarted_shard_gets_its_rows_back_from_the_checkpoint(tmp_path: Path) -> None:
    first = _start(tmp_path)
    keys = _keys(2000)
    client = RowClient(first.group(), DIM)
    client.push(keys, np.random.default_rng(2).standard_normal((keys.size, DIM)).astype(np.float32))
    # a step to save
    Float32Dense(first.group()).push(np.ones(LAYOUT.total, np.float32), steps=[0, 0], examples=1, loss=1.0)
    rows, _ = client.pull(keys)
    saved = [(t.keys[: t.n].copy(), t.accumulators[: t.n].copy(), t.touched[: t.n].copy()) for t in _tables(first)]
    first.stop()  # each shard writes its final checkpoint
    second = _start(tmp_path)
    try:
        again, _ = RowClient(second.group(), DIM).pull(keys)
        np.testing.assert_array_equal(again, rows)
        for (keys_before, acc, touched), table in zip(saved, _tables(second)):
            np.testing.assert_array_equal(table.keys[: table.n], keys_before)
            np.testing.assert_array_equal(table.accumulators[: table.n], acc)
            np.testing.assert_allclose(table.touched[: table.n], touched, atol=0.01)
    finally:
        second.stop()


def test_keys_survive_the_checkpoints_float32_encoding_exactly() -> None:
    keys = np.array([0, 1, 2**21 - 1, 2**21, 2**42 + 5, 2**63 - 1], dtype=np.int64)
    parts = rowcheckpoint.key_parts(keys)
    assert parts.dtype == np.float32 and np.isfinite(parts).all()
    np.testing.assert_array_equal(rowcheckpoint.keys_from_parts(parts), keys)


def test_more_keys_than_one_request_may_carry_go_in_several(live: LiveShards, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sparse, "MAX_KEYS", 64)  # for the client's chunks and the shards' bound alike
    keys = _keys(500)
    client = RowClient(live.group(), DIM)
    client.push(keys, np.ones((keys.size, DIM), np.float32))
    assert sum(t.n for t in _tables(live)) == keys.size
    rows, _ = client.pull(keys)
    np.testing.assert_allclose(rows, initial_rows(keys, DIM, SEED) - LR / (1 + EPSILON), rtol=1e-5, atol=1e-6)


def test_wide_rows_lower_the_keys_a_request_may_carry_so_frames_stay_bounded() -> None:
    assert sparse.keys_per_request(4) == sparse.MAX_KEYS
    assert sparse.keys_per_request(1024) == sparse.MAX_ROW_VALUES // 1024
    assert sparse.keys_per_request(1024) * 1024 * 4 <= 64 * 2**20


def test_admission_counts_and_rows_survive_a_restart(tmp_path: Path) -> None:
    first = _start(tmp_path, admit_after=3)
    keys = _keys(100)
    client = RowClient(first.group(), DIM)
    for _ in range(2):  # two of the three pushes a key needs
        client.push(keys, np.ones((keys.size, DIM), np.float32))
    Float32Dense(first.group()).push(np.ones(LAYOUT.total, np.float32), steps=[0, 0], examples=1, loss=1.0)
    assert sum(t.n for t in _tables(first)) == 0
    first.stop()
    second = _start(tmp_path, admit_after=3)
    try:
        RowClient(second.group(), DIM).push(keys, np.ones((keys.size, DIM), np.float32))
        assert sum(t.n for t in _tables(second)) == keys.size  # the third push, counted across the restart
    finally:
        second.stop()


def test_a_key_that_occurs_admit_after_times_in_one_push_gets_its_row(tmp_path: Path) -> None:
    live = _start(tmp_path, admit_after=3)
    try:
        keys = _keys(40)
        occurrences = np.where(np.arange(keys.size) % 2 == 0, 3, 2)  # half occurred 3 times, half twice
        RowClient(live.group(), DIM).push(keys, np.ones((keys.size, DIM), np.float32), occurrences)
        held = np.concatenate([t.keys[: t.n] for t in _tables(live)])
        np.testing.assert_array_equal(np.sort(held), np.sort(keys[occurrences == 3]))
    finally:
        live.stop()


def test_the_shard_evicts_expired_rows_when_a_push_comes_after_the_interval(live: LiveShards) -> None:
    keys = _keys(300)
    mine = keys[owner_of(keys, 2) == 0]
    client = RowClient(live.group(), DIM)
    client.push(mine, np.ones((mine.size, DIM), np.float32))
    plugin = live.shards[0].plugin(SparseRows)
    plugin.table.expire_after = 60.0
    plugin.table.touched[: plugin.table.n - 1] -= 3600  # all but the newest row were pushed an hour ago
    plugin._next_expiry = 0.0
    client.push(mine[:1], np.ones((1, DIM), np.float32))
    assert plugin.table.n == 2  # mine[0], pushed just now, and the row that was never aged
    assert plugin.table.lookup(mine[:1])[0] >= 0


def test_a_sparse_replica_moves_only_its_minibatches_rows_and_learns(tmp_path: Path) -> None:
    """A SparseWorker against live shards: the shards hold exactly the rows of the keys the
    replica's minibatches touched (not the id space), and the held-out loss falls."""
    x, y, ids = data.read_source("synthetic-ctr:fields=4,ids=100000,samples=4000,zipf=1.1,seed=2")
    dataset = data.split(x, y, ids=ids, test_fraction=0.25, seed=0)
    model = EmbeddingModel(models.Mlp(4 * DIM, 2), dense_features=0, fields=4, dim=DIM)
    layout = Layout.of(model.shapes, shards=2)

    def attach(shard) -> None:
        shard.attach(SparseRows(shard, dim=DIM, learning_rate=0.05, seed=SEED))
    live = start_shards(tmp_path, layout, model.init_params(0), attach=attach, checkpoint_every=3600,
                        learning_rate=0.05)
    try:
        worker = SparseWorker(jobspec.Training(batch_size=64), live.group(), model, dataset,
                              WorkerMetrics(prom.CollectorRegistry()), seed=1)
        seen: list[np.ndarray] = []
        real_push = worker.rows.push
        worker.rows.push = lambda keys, *rest: (seen.append(keys), real_push(keys, *rest))[1]
        score = held_out_inputs(model, live.group(), dataset.x_test, dataset.ids_test)
        params = np.empty(layout.total, np.float32)

        def held_out_loss() -> float:
            Float32Dense(live.group()).pull(params)
            mlp, inputs = score()
            return models.evaluate(mlp, params, inputs, dataset.y_test)[0]

        before = held_out_loss()
        assert worker._join()
        for _ in range(150):
            assert not worker._pull()
            worker._compute()
            assert not worker._push(64, 0.5, fetch=False)
        touched = np.unique(np.concatenate(seen))
        assert sum(t.n for t in _tables(live)) == touched.size < 4 * 100_000 // 10
        for table in _tables(live):
            np.testing.assert_array_equal(np.isin(table.keys[: table.n], touched), True)
        assert held_out_loss() < before - 0.01
    finally:
        live.stop()
