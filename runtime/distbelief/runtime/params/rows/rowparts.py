"""A sparse shard's rows sent to a copy catching up, a part at a time (plugin.Transferable,
shard/copies/transfer.py).

A part is the set of keys whose hash (rowkeys.mix) starts with the part's number in its top
`bits` bits. The admission counters are indexed by the top COUNTER_BITS bits of the same
hash (rowtable.COUNTERS), so the keys of a part own a range of counters of their own: a
part is its rows and its counters, and a push of a key touches that key's part alone.
While receiving, a copy skips the keys of the parts it has not received yet (neither
counted nor applied: Receiving.keep); when such a part comes it holds their state after
those pushes. Parts are sized to hold about PART_BYTES of rows each.

The primary sorts its rows by part once per transfer (PartIndex: 4 bytes a row, beside the
81 of the rows themselves) and copies out one part at a time.
"""

from __future__ import annotations

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.params.rows.rowtable import COUNTERS, OPTIONAL_ARRAYS, RowTable
from distbelief.runtime.wire.rowkeys import mix

PART_BYTES = 2 << 20
COUNTER_BITS = COUNTERS.bit_length() - 1   # the counters are indexed by the hash's top 20 bits
ROW_ARRAYS = ("keys", "values", "accumulators", "touched")
CHUNK_ROWS = 1 << 20


def part_bits(rows: int, dim: int) -> int:
    """How many top bits of the hash number the parts of a table of `rows` rows: the fewest
    that give parts of about PART_BYTES / 2 on average (hashes spread them evenly)."""
    per_part = max(1, PART_BYTES // (2 * max(8, 4 * dim)))
    bits = 0
    while bits < COUNTER_BITS and rows >> bits > per_part:
        bits += 1
    return bits


def parts_of(keys: np.ndarray, bits: int) -> np.ndarray:
    if bits == 0:
        return np.zeros(keys.size, dtype=np.int64)
    return (mix(keys) >> np.uint64(64 - bits)).astype(np.int64)


def counter_range(part: int, bits: int) -> slice:
    span = 1 << (COUNTER_BITS - bits)
    return slice(part * span, (part + 1) * span)


class PartIndex:
    """The primary's rows sorted by part, as the table is when a transfer begins; rows made
    after are found when their part is read. 4 bytes a row while the transfer lasts, about
    14 a moment while it is made (the hashes go a chunk of rows at a time)."""

    def __init__(self, table: RowTable, bits: int) -> None:
        self.bits, self.first_new = bits, table.n
        parts = np.empty(table.n, dtype=np.uint16 if bits <= 16 else np.uint32)
        for start in range(0, table.n, CHUNK_ROWS):
            stop = min(table.n, start + CHUNK_ROWS)
            parts[start:stop] = parts_of(table.keys[start:stop], bits)
        self.order = np.argsort(parts, kind="stable").astype(np.int32)
        self.bounds = np.concatenate([[0], np.cumsum(np.bincount(parts, minlength=1 << bits))])

    def rows(self, table: RowTable, part: int) -> np.ndarray:
        old = self.order[self.bounds[part]:self.bounds[part + 1]].astype(np.int64)
        made = self.first_new + np.flatnonzero(parts_of(table.keys[self.first_new:table.n], self.bits) == part)
        return np.concatenate([old, made])


def read(table: RowTable, index: PartIndex, part: int) -> dict[str, np.ndarray]:
    rows = index.rows(table, part)
    arrays = {name: getattr(table, name)[rows] for name in ROW_ARRAYS}  # fancy indexing: copies
    for name in OPTIONAL_ARRAYS:  # the wide part's accumulators, L2's steps, embedAfter's counts
        if getattr(table, name) is not None:
            arrays[name] = getattr(table, name)[rows]
    if table.counts is not None:
        arrays["counters"] = table.counts[counter_range(part, index.bits)].copy()
    return arrays


def write(table: RowTable, part: int, bits: int, arrays: dict[str, np.ndarray]) -> None:
    """Part `part` of the primary's table into this one, which holds none of its keys yet."""
    keys = arrays.get("keys")
    if keys is None or not all(name in arrays for name in ROW_ARRAYS):
        raise errors.ProtocolError(f"a part of rows carries {sorted(arrays)}")
    n = keys.size
    if arrays["values"].shape != (n, table.dim) or arrays["accumulators"].shape != (n,) or arrays["touched"].shape != (n,):
        raise errors.ProtocolError(f"part {part}: {n} keys with rows of shape {arrays['values'].shape}")
    if n and (parts_of(keys, bits) != part).any():
        raise errors.ProtocolError(f"part {part} carries keys of other parts")
    extra = {name: arrays[name] for name in OPTIONAL_ARRAYS if name in arrays}
    if any(extra[name].shape != (n,) for name in extra):
        raise errors.ProtocolError(f"part {part}: {n} keys with {({k: v.shape for k, v in extra.items()})}")
    table.put(keys.astype(np.int64), arrays["values"], arrays["accumulators"], arrays["touched"], extra)
    if table.counts is not None:
        counters = arrays.get("counters")
        target = table.counts[counter_range(part, bits)]
        if counters is None or counters.shape != target.shape:
            raise errors.ProtocolError(f"part {part} carries no admission counters of {target.size}")
        target[...] = counters


class Receiving:
    """Which parts a copy catching up has received."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.received = np.zeros(1 << bits, dtype=bool)

    def keep(self, keys: np.ndarray) -> np.ndarray:
        """The keys a push may touch now: those of parts already received."""
        return self.received[parts_of(keys, self.bits)]
