"""The embedding row table: hash index, row-wise Adagrad, admission, expiry, state."""

from __future__ import annotations

import numpy as np

from distbelief.runtime.params.rows import rowtable
from distbelief.runtime.params.rows.rowtable import RowTable, initial_rows

DIM = 4


def _keys(n: int, seed: int = 0) -> np.ndarray:
    return np.unique(np.random.default_rng(seed).integers(0, 2**63 - 1, n, dtype=np.int64))


def test_lookup_finds_every_created_row_across_growth() -> None:
    table = RowTable(DIM, learning_rate=0.1, seed=1)
    keys = _keys(20_000)  # 20x the first capacity: the rows and the index double many times
    for chunk in np.array_split(keys, 7):
        table.update(chunk, np.zeros((chunk.size, DIM), np.float32), now=0.0)
    assert table.n == keys.size
    index = table.lookup(keys)
    np.testing.assert_array_equal(np.sort(index), np.arange(keys.size))
    np.testing.assert_array_equal(table.keys[index], keys)
    assert (table.lookup(_keys(1000, seed=9)) == -1).all()


def test_colliding_keys_in_one_batch_all_get_their_own_slot() -> None:
    table = RowTable(DIM, learning_rate=0.1, seed=1)
    keys = np.arange(200_000, dtype=np.int64)
    homes = table._home(keys)
    same_slot = keys[homes == homes[0]]
    # Many keys on one slot (fewer than MIN_ROWS in all, so the index is not rebuilt):
    # linear probing has to resolve clashes within one round.
    crowd = np.unique(np.r_[same_slot, np.arange(0, 2400, 3)])
    assert same_slot.size > 20 and crowd.size < rowtable.MIN_ROWS
    table.update(crowd, np.ones((crowd.size, DIM), np.float32), now=0.0)
    np.testing.assert_array_equal(table.keys[table.lookup(crowd)], crowd)


def test_a_missing_row_reads_as_its_initial_value_and_is_not_created() -> None:
    table = RowTable(DIM, learning_rate=0.1, seed=7)
    keys = np.array([3, 2**62, 12345], dtype=np.int64)
    np.testing.assert_array_equal(table.rows(keys), initial_rows(keys, DIM, 7))
    assert table.n == 0


def test_initial_rows_depend_on_key_and_seed_only() -> None:
    keys = _keys(1000)
    first = initial_rows(keys, 16, seed=3)
    np.testing.assert_array_equal(first[::-1], initial_rows(keys[::-1], 16, seed=3))
    assert not np.allclose(first, initial_rows(keys, 16, seed=4))
    assert np.abs(first).max() <= rowtable.INIT_SCALE
    assert abs(float(first.mean())) < 0.005 and first.std() > 0.02  # spread over the range, centred
    assert np.unique(first[:, 0]).size > 990  # rows differ


def test_update_is_row_wise_adagrad_from_the_initial_value() -> None:
    table = RowTable(DIM, learning_rate=0.5, seed=2)
    keys = np.array([10, 20], dtype=np.int64)
    rng = np.random.default_rng(0)
    expected, acc = initial_rows(keys, DIM, 2).astype(np.float64), np.zeros(2)
    for _ in range(3):
        g = rng.standard_normal((2, DIM)).astype(np.float32)
        table.update(keys, g, now=1.0)
        acc += (g.astype(np.float64) ** 2).mean(axis=1)
        expected -= 0.5 * g / (np.sqrt(acc)[:, None] + rowtable.EPSILON)
    np.testing.assert_allclose(table.rows(keys), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(table.accumulators[table.lookup(keys)], acc, rtol=1e-5)


def test_update_is_plain_sgd_when_the_job_asks_for_it() -> None:
    table = RowTable(DIM, learning_rate=0.5, seed=2, optimizer="sgd")
    keys = np.array([10, 20], dtype=np.int64)
    rng = np.random.default_rng(0)
    expected = initial_rows(keys, DIM, 2).astype(np.float64)
    for _ in range(3):
        g = rng.standard_normal((2, DIM)).astype(np.float32)
        table.update(keys, g, now=1.0)
        expected -= 0.5 * g
    np.testing.assert_allclose(table.rows(keys), expected, rtol=1e-5, atol=1e-6)


def test_a_row_is_created_by_its_admitted_push_only() -> None:
    table = RowTable(DIM, learning_rate=0.5, seed=2, admit_after=3)
    keys = np.array([5, 6], dtype=np.int64)
    g = np.ones((2, DIM), np.float32)
    assert table.update(keys, g, now=0.0) == 0
    assert table.update(keys[:1], g[:1], now=0.0) == 0
    assert table.n == 0
    assert table.update(keys, g, now=0.0) == 1  # key 5's third push; key 6 has two
    np.testing.assert_array_equal(table.lookup(keys) >= 0, [True, False])
    # The admitted push is applied: the row moved off its initial value.
    assert not np.allclose(table.rows(keys[:1]), initial_rows(keys[:1], DIM, 2))


def test_admission_counts_occurrences_not_pushes() -> None:
    table = RowTable(DIM, learning_rate=0.5, seed=2, admit_after=3)
    keys = np.array([5, 6, 7], dtype=np.int64)
    g = np.ones((3, DIM), np.float32)
    # One push: key 5 occurred 3 times in its examples, key 6 twice, key 7 once.
    assert table.update(keys, g, now=0.0, occurrences=np.array([3, 2, 1])) == 1
    np.testing.assert_array_equal(table.lookup(keys) >= 0, [True, False, False])
    assert table.update(keys[1:], g[1:], now=0.0, occurrences=np.array([1, 1])) == 1  # key 6's third
    np.testing.assert_array_equal(table.lookup(keys) >= 0, [True, True, False])
    # A huge count admits at once and does not wrap the counter around.
    assert table.update(keys[2:], g[2:], now=0.0, occurrences=np.array([2**32 - 1])) == 1


def test_expiry_drops_rows_not_pushed_to_and_keeps_the_others_intact() -> None:
    table = RowTable(DIM, learning_rate=0.5, seed=2, expire_after=10.0)
    old, fresh = np.arange(0, 3000, dtype=np.int64), np.arange(3000, 3500, dtype=np.int64)
    table.update(old, np.ones((old.size, DIM), np.float32), now=100.0)
    table.update(fresh, np.ones((fresh.size, DIM), np.float32), now=105.0)
    kept = table.rows(fresh)
    assert table.expire(now=112.0) == old.size
    assert table.n == fresh.size
    np.testing.assert_array_equal(table.rows(fresh), kept)
    assert (table.lookup(old) == -1).all()
    np.testing.assert_array_equal(table.rows(old[:5]), initial_rows(old[:5], DIM, 2))
    assert table.nbytes() < 200_000  # memory follows the rows that are left


def test_expiry_compacts_in_chunks_and_gives_the_memory_back(monkeypatch) -> None:
    monkeypatch.setattr(rowtable, "CHUNK", 97)  # many chunks, with kept and dropped rows in each
    table = RowTable(DIM, learning_rate=0.5, seed=2, expire_after=10.0)
    keys = _keys(5000)
    table.update(keys, np.ones((keys.size, DIM), np.float32), now=100.0)
    fresh = keys[np.random.default_rng(1).random(keys.size) < 0.3]
    table.update(fresh, np.full((fresh.size, DIM), 2, np.float32), now=105.0)
    kept, full = table.rows(fresh), table.nbytes()
    assert table.expire(now=112.0) == keys.size - fresh.size
    np.testing.assert_array_equal(table.rows(fresh), kept)
    np.testing.assert_array_equal(np.sort(table.keys[: table.n]), np.sort(fresh))
    assert (table.lookup(np.setdiff1d(keys, fresh)) == -1).all()
    assert table.nbytes() < full / 2


def test_load_replaces_every_row() -> None:
    table = RowTable(DIM, learning_rate=0.5, seed=2)
    table.update(np.arange(10, dtype=np.int64), np.ones((10, DIM), np.float32), now=0.0)
    keys = np.array([7, 2**60], dtype=np.int64)
    values = np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM)
    table.load(keys, values, np.array([1.0, 2.0], np.float32), np.array([5.0, 6.0]))
    assert table.n == 2
    np.testing.assert_array_equal(table.rows(keys), values)
    assert table.lookup(np.array([3], dtype=np.int64))[0] == -1


def test_the_wide_values_start_at_zero_and_keep_an_accumulator_of_their_own() -> None:
    table = RowTable(6, learning_rate=0.5, seed=2, wide=2)
    keys = np.array([5, 9], dtype=np.int64)
    start = table.rows(keys)
    np.testing.assert_array_equal(start[:, 4:], 0)
    np.testing.assert_array_equal(start[:, :4], initial_rows(keys, 6, 2)[:, :4])
    # Embedding gradients 100x smaller than the wide ones: each part takes a full Adagrad
    # step of its own (one shared accumulator would shrink the embedding's step 100-fold).
    grads = np.array([[0.01] * 4 + [1.0, -1.0], [0.01] * 4 + [1.0, -1.0]], np.float32)
    table.update(keys, grads, now=0.0)
    moved = table.rows(keys) - start
    np.testing.assert_allclose(moved[:, :4], -0.5, rtol=1e-5)
    np.testing.assert_allclose(moved[:, 4:], [[-0.5, 0.5]] * 2, rtol=1e-5)
    np.testing.assert_allclose(table.accumulators[:2], 1e-4, rtol=1e-5)
    np.testing.assert_allclose(table.wide_accumulators[:2], 1.0, rtol=1e-5)


def test_lazy_l2_charges_a_row_for_every_step_since_its_last_push() -> None:
    l2 = 0.01
    table = RowTable(DIM, learning_rate=0.1, seed=2, l2=l2)
    key = np.array([77], dtype=np.int64)
    table.update(key, np.full((1, DIM), 0.3, np.float32), now=0.0, step=10)
    value = table.rows(key)[0].copy()
    acc = float(table.accumulators[0])
    table.update(key, np.zeros((1, DIM), np.float32), now=0.0, step=60)  # 50 steps later, no data gradient
    g = l2 * 50 * value
    acc += float(np.mean(g * g))
    np.testing.assert_allclose(table.rows(key)[0], value - 0.1 * g / np.sqrt(acc), rtol=1e-5)
    assert table.stepped[0] == 60
    # Pushed again at the same step: charged for one step, not zero.
    before = table.rows(key)[0].copy()
    table.update(key, np.zeros((1, DIM), np.float32), now=0.0, step=60)
    assert (np.sign(table.rows(key)[0] - before) == -np.sign(before)).all()


def test_lazy_l2_of_the_wide_values_has_its_own_weight() -> None:
    table = RowTable(4, learning_rate=0.1, seed=2, wide=1, l2=0.0, wide_l2=0.5)
    key = np.array([1], dtype=np.int64)
    table.update(key, np.array([[0.2, 0.2, 0.2, 1.0]], np.float32), now=0.0, step=0)
    embedding, wide = table.rows(key)[0, :3].copy(), float(table.rows(key)[0, 3])
    acc = float(table.wide_accumulators[0])
    table.update(key, np.zeros((1, 4), np.float32), now=0.0, step=3)
    np.testing.assert_array_equal(table.rows(key)[0, :3], embedding)  # l2 = 0: untouched
    g = 0.5 * 3 * wide
    np.testing.assert_allclose(table.rows(key)[0, 3], wide - 0.1 * g / np.sqrt(acc + g * g), rtol=1e-5)


def test_embedding_values_are_read_as_zero_and_not_trained_until_embed_after_occurrences() -> None:
    table = RowTable(5, learning_rate=0.5, seed=4, wide=1, embed_after=5)
    key = np.array([42], dtype=np.int64)
    np.testing.assert_array_equal(table.rows(key), 0)  # no row: all 0, wide values included
    ones = np.ones((1, 5), np.float32)
    table.update(key, ones, now=0.0, occurrences=np.array([3]))
    row = table.rows(key)[0]
    np.testing.assert_array_equal(row[:4], 0)  # 3 of 5 occurrences: the embedding is not in use
    assert row[4] == -0.5  # the wide value learns from the first push
    table.update(key, ones, now=0.0, occurrences=np.array([2]))  # the push that reaches 5 still counts as cold
    row = table.rows(key)[0]
    np.testing.assert_array_equal(row[:4], initial_rows(key, 5, 4)[0, :4])  # in use now, untrained
    table.update(key, ones, now=0.0, occurrences=np.array([1]))
    np.testing.assert_allclose(table.rows(key)[0, :4], initial_rows(key, 5, 4)[0, :4] - 0.5, rtol=1e-5)
    assert table.occurrences[0] == 5  # capped


def test_optional_arrays_follow_growth_compaction_and_load() -> None:
    table = RowTable(DIM + 1, learning_rate=0.1, seed=1, wide=1, l2=1e-3, embed_after=3, expire_after=10.0)
    keys = _keys(5000)
    table.update(keys, np.ones((keys.size, DIM + 1), np.float32), now=100.0, step=7,
                 occurrences=np.full(keys.size, 2))
    assert {"wide_accumulators", "stepped", "occurrences"} <= set(table.row_arrays)
    table.update(keys[:10], np.ones((10, DIM + 1), np.float32), now=200.0, step=9)
    assert table.expire(205.0) == keys.size - 10
    index = table.lookup(keys[:10])
    assert (table.stepped[index] == 9).all() and (table.occurrences[index] == 3).all()
    assert (table.wide_accumulators[index] > 0).all()
    extra = {name: getattr(table, name)[: table.n].copy() for name in ("wide_accumulators", "stepped", "occurrences")}
    other = RowTable(DIM + 1, learning_rate=0.1, seed=1, wide=1, l2=1e-3, embed_after=3)
    other.load(table.keys[: table.n], table.values[: table.n], table.accumulators[: table.n],
               table.touched[: table.n], extra=extra)
    np.testing.assert_array_equal(other.rows(keys[:10]), table.rows(keys[:10]))
    np.testing.assert_array_equal(other.occurrences[: other.n], extra["occurrences"])
    # Rows loaded without the optional arrays: L2 counts from the table's step, embeddings in use.
    bare = RowTable(DIM + 1, learning_rate=0.1, seed=1, wide=1, l2=1e-3, embed_after=3)
    bare.step = 50
    bare.load(table.keys[: table.n], table.values[: table.n], table.accumulators[: table.n], table.touched[: table.n])
    assert (bare.stepped[: bare.n] == 50).all() and (bare.occurrences[: bare.n] == 3).all()
    assert (bare.wide_accumulators[: bare.n] == 0).all()
