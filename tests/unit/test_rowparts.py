"""A sparse shard's rows in parts, for a copy catching up (params/rows/rowparts.py): every row
and admission counter in exactly one part, parts of a bounded size, and the primary's memory
for a transfer a few bytes a row, not a second copy of the table."""

from __future__ import annotations

import tracemalloc

import numpy as np

from distbelief.runtime.params.rows import rowparts
from distbelief.runtime.params.rows.rowtable import COUNTERS, RowTable


def table_of(rows: int, dim: int = 16) -> RowTable:
    table = RowTable(dim, learning_rate=0.1, seed=1, admit_after=3)
    keys = np.random.default_rng(1).choice(1 << 40, size=rows, replace=False).astype(np.int64)
    table.update(keys, np.ones((rows, dim), np.float32), 0.0, np.full(rows, 3))  # admitted at once
    table.update(keys[:1000] + (1 << 41), np.ones((1000, dim), np.float32), 0.0)  # counted only
    return table


def test_the_parts_hold_every_row_and_counter_once_and_rebuild_the_table() -> None:
    source = table_of(200_000)
    bits = rowparts.part_bits(source.n, source.dim)
    assert bits > 0
    index = rowparts.PartIndex(source, bits)
    made_after = np.arange(5) + (1 << 42)  # rows made while the transfer runs are found too
    source.update(made_after, np.ones((5, 16), np.float32), 0.0, np.full(5, 3))
    target = RowTable(16, learning_rate=0.1, seed=1, admit_after=3)
    largest = 0
    for part in range(1 << bits):
        arrays = rowparts.read(source, index, part)
        largest = max(largest, max(a.nbytes for a in arrays.values()))
        rowparts.write(target, part, bits, arrays)
    assert largest <= rowparts.PART_BYTES * 2 and target.n == source.n
    assert set(target.keys[:target.n].tolist()) == set(source.keys[:source.n].tolist())
    rows = source.keys[:source.n]
    np.testing.assert_array_equal(target.rows(rows), source.rows(rows))
    np.testing.assert_array_equal(target.counts, source.counts)
    assert target.counts.size == COUNTERS and target.counts.any()


def test_a_transfer_costs_the_primary_a_few_bytes_a_row_not_a_copy_of_the_table() -> None:
    table = table_of(1_000_000)
    bits = rowparts.part_bits(table.n, table.dim)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = rowparts.PartIndex(table, bits)
        held, made = (m - base for m in tracemalloc.get_traced_memory())
        tracemalloc.reset_peak()
        for part in range(1 << bits):
            arrays = rowparts.read(table, index, part)
            del arrays
        reading = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    rows = table.n
    assert held <= 5 * rows, f"{held / rows:.1f} bytes a row held for the transfer"
    # sorting: the parts (2 bytes a row), numpy's int64 order and its int32 copy, and the
    # hashes of one chunk of rows at a time
    assert made <= 14 * rows + 24 * rowparts.CHUNK_ROWS, f"{made / rows:.1f} bytes a row while sorting"
    assert reading <= held + 4 * rowparts.PART_BYTES, reading
    assert made < table.nbytes() / 4


def test_a_wide_table_with_l2_and_embed_after_sends_its_own_arrays_too() -> None:
    options = {"wide": 2, "l2": 1e-3, "wide_l2": 3e-5, "embed_after": 3}
    source = RowTable(10, learning_rate=0.1, seed=1, **options)
    keys = np.random.default_rng(2).choice(1 << 40, size=5000, replace=False).astype(np.int64)
    source.update(keys, np.ones((5000, 10), np.float32), 0.0, np.full(5000, 2), step=7)
    source.update(keys[:100], np.ones((100, 10), np.float32), 0.0, np.full(100, 2), step=9)  # embedded now
    bits = rowparts.part_bits(source.n, source.dim)
    index = rowparts.PartIndex(source, bits)
    target = RowTable(10, learning_rate=0.1, seed=1, **options)
    for part in range(1 << bits):
        rowparts.write(target, part, bits, rowparts.read(source, index, part))
    at = target.lookup(keys)
    for name in ("wide_accumulators", "stepped", "occurrences", "accumulators", "values"):
        np.testing.assert_array_equal(getattr(target, name)[at], getattr(source, name)[source.lookup(keys)], name)
    np.testing.assert_array_equal(target.rows(keys), source.rows(keys))  # embedded or not, as on the primary
    assert (target.occurrences[at[:100]] == 3).all() and (target.occurrences[at[100:]] == 2).all()  # counted up to 3
