"""A table of embedding rows keyed by 63-bit keys, over numpy arrays: the sparse shard's state.

    lookup(keys)           -> row index per key, -1 where the key has no row
    rows(keys)             -> the rows' values; a key without a row gets its initial value
    update(keys, grads, now, occurrences)
                           row-wise Adagrad on the rows that exist or are admitted now
    expire(now)            drops the rows not pushed to for expire_after seconds

Layout. The rows live in arrays appended in creation order: keys int64 [n], values
float32 [n, dim], one Adagrad accumulator float32 [n], the second of the last push uint32
[n] and a changed-since-the-last-checkpoint flag bool [n]: 81 bytes a row at dim 16. An
open-addressing index (linear probing) maps a key to its row: int32 row numbers only (the
key is read from the rows), at a load factor between MIN_LOAD and MAX_LOAD (1/2 to 3/4: 5.3
to 8 bytes a row). The row arrays grow by GROWTH (1/8) in place (ndarray.resize: realloc,
which moves pages instead of copying them), so growing never holds two copies of the table
and at most 1/8 of it is slack; the index is rebuilt, larger, when it passes MAX_LOAD (the
old index is dropped first). Keeping rows apart from the index makes expiry a compaction
followed by an index rebuild (no tombstones) and a checkpoint the first n rows as they
are. Probing is vectorised: every pending key moves one slot per round, so a batch costs a
few numpy passes, with no per-row Python loop. Memory follows the rows that exist, never
the id space.

Optimizer. Adagrad is row-wise, as TorchRec's: one accumulator per row holding the mean
of the squared gradient over the row's elements. It keeps 1/dim of per-element Adagrad's
optimizer state (at dim 16, 4 bytes per row instead of 64), so the table's memory is
almost only its values; the elements of one embedding row see the same examples and have
gradients of similar scale, so one rate per row loses little.

Initial values are a counter-based hash of (key, seed, element) turned into a uniform in
[-INIT_SCALE, INIT_SCALE): any shard, replica or restart computes the same row without
storing or sending it.

Admission. A key gets a row once it has occurred admit_after times: an occurrence is one
appearance of the id in a training example whose gradient a replica pushed (a minibatch
with the id in 5 examples counts 5). The push that brings the count to admit_after creates
the row and is applied to it; the gradients of the pushes before are dropped. Counts live
in a fixed array of COUNTERS counters indexed by key hash (bounded memory; two keys
sharing a counter are admitted a little early).
"""

from __future__ import annotations

import numpy as np

from distbelief.runtime.wire.rowkeys import GOLDEN, mix

EMPTY = np.int32(-1)          # an index slot without a row
INIT_SCALE = 0.05
EPSILON = 1e-8
MIN_ROWS = 1024
GROWTH = 8                    # the row arrays grow by 1/GROWTH of their size at a time
MIN_LOAD, MAX_LOAD = 0.5, 0.75  # the index's load factor: rebuilt at MIN_LOAD when past MAX_LOAD
CHUNK = 1 << 20               # rows per pass of an index rebuild or a compaction
COUNTERS = 1 << 20            # admission counters (4 MiB), shared by all not-yet-admitted keys
ROW_ARRAYS = ("keys", "values", "accumulators", "touched", "dirty")
_LOW32 = np.uint64(0xFFFFFFFF)


def initial_rows(keys: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """Each key's initial row: uniform in [-INIT_SCALE, INIT_SCALE), deterministic in (key, seed)."""
    base = mix(keys.astype(np.uint64) ^ mix(np.array([seed], dtype=np.uint64)))
    counters = base[:, None] + np.arange(1, dim + 1, dtype=np.uint64)[None, :] * GOLDEN
    unit = (mix(counters) >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)
    return (unit * np.float32(2 * INIT_SCALE) - np.float32(INIT_SCALE)).astype(np.float32)


class RowTable:
    def __init__(self, dim: int, *, learning_rate: float, seed: int, admit_after: int = 1,
                 expire_after: float | None = None) -> None:
        self.dim, self.seed = dim, seed
        self.learning_rate = np.float32(learning_rate)
        self.admit_after = admit_after
        self.expire_after = expire_after
        self.n = 0
        self.keys = np.empty(MIN_ROWS, dtype=np.int64)
        self.values = np.empty((MIN_ROWS, dim), dtype=np.float32)
        self.accumulators = np.empty(MIN_ROWS, dtype=np.float32)
        self.touched = np.empty(MIN_ROWS, dtype=np.uint32)   # whole seconds of the Unix epoch
        self.dirty = np.zeros(MIN_ROWS, dtype=bool)          # changed since clean() (incremental checkpoints)
        self._index = np.full(_index_size(0), EMPTY, dtype=np.int32)  # rows per shard < 2**31
        self.counts = np.zeros(COUNTERS, dtype=np.uint32) if admit_after > 1 else None

    # -- reading -------------------------------------------------------------------------

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The row index of each key, -1 for a key without a row."""
        found = np.full(keys.size, -1, dtype=np.int64)
        slots = self._home(keys)
        pending = np.arange(keys.size)
        while pending.size:
            at = slots[pending]
            row = self._index[at]
            occupied = row != EMPTY
            hit = occupied.copy()
            hit[occupied] = self.keys[row[occupied]] == keys[pending[occupied]]
            found[pending[hit]] = row[hit]
            pending = pending[occupied & ~hit]
            slots[pending] = self._next(slots[pending])
        return found

    def rows(self, keys: np.ndarray) -> np.ndarray:
        """The current rows of keys (a copy); a key without a row gets its initial value."""
        index = self.lookup(keys)
        out = np.empty((keys.size, self.dim), dtype=np.float32)
        present = index >= 0
        out[present] = self.values[index[present]]
        if not present.all():
            out[~present] = initial_rows(keys[~present], self.dim, self.seed)
        return out

    # -- writing -------------------------------------------------------------------------

    def update(self, keys: np.ndarray, grads: np.ndarray, now: float, occurrences: np.ndarray | None = None) -> int:
        """Row-wise Adagrad on the rows of keys (unique), creating the admitted ones; returns
        how many rows were updated. occurrences: how many times each key occurred in the
        pushed examples (None: once each); a key not yet admitted is only counted."""
        index = self.lookup(keys)
        missing = index < 0
        if missing.any():
            counted = None if occurrences is None else occurrences[missing]
            admitted = np.flatnonzero(missing)[self._admit(keys[missing], counted)]
            index[admitted] = self._create(keys[admitted])
        live = index >= 0
        rows, g = index[live], grads[live]
        acc = self.accumulators[rows] + np.mean(g * g, axis=1)
        self.accumulators[rows] = acc
        scale = self.learning_rate / (np.sqrt(acc) + np.float32(EPSILON))
        self.values[rows] -= g * scale[:, None]
        self.touched[rows] = int(now)
        self.dirty[rows] = True
        return int(rows.size)

    def _admit(self, keys: np.ndarray, occurrences: np.ndarray | None) -> np.ndarray:
        """Which of these keys (without rows) have now occurred admit_after times."""
        if self.counts is None:
            return np.ones(keys.size, dtype=bool)
        counters = (mix(keys) >> np.uint64(44)).astype(np.int64) % COUNTERS
        add = np.ones(keys.size, dtype=np.uint32) if occurrences is None else occurrences.astype(np.uint32)
        np.add.at(self.counts, counters, np.minimum(add, self.admit_after))
        reached = np.minimum(self.counts[counters], self.admit_after)  # capped: a counter never wraps
        self.counts[counters] = reached
        return reached >= self.admit_after

    def _create(self, keys: np.ndarray) -> np.ndarray:
        """New rows for keys (unique, without rows) at their initial values; their indices."""
        self._reserve(self.n + keys.size)
        rows = np.arange(self.n, self.n + keys.size)
        self.keys[rows] = keys
        self.values[rows] = initial_rows(keys, self.dim, self.seed)
        self.accumulators[rows] = 0.0
        self.n += keys.size
        self._insert(keys, rows)
        return rows

    def _reserve(self, rows: int) -> None:
        if rows > self.keys.size:
            capacity = self.keys.size
            while capacity < rows:
                capacity += capacity // GROWTH
            self._resize(capacity)
        if rows > MAX_LOAD * self._index.size:
            self._rebuild_index(rows)

    def _resize(self, capacity: int) -> None:
        for name in ROW_ARRAYS:  # in place: no other reference to these arrays outlives a request
            getattr(self, name).resize((capacity, *getattr(self, name).shape[1:]), refcheck=False)

    def _rebuild_index(self, rows: int) -> None:
        self._index = np.empty(0, dtype=np.int32)  # dropped first: never two indexes at once
        self._index = np.full(_index_size(rows), EMPTY, dtype=np.int32)
        for start in range(0, self.n, CHUNK):  # in chunks: the probing temporaries stay small
            stop = min(self.n, start + CHUNK)
            self._insert(self.keys[start:stop], np.arange(start, stop))

    def _insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Put keys (unique, absent) into the index. Keys probing to the same free slot in
        one round all write it; the one whose row stays there has it, the others probe on."""
        slots = self._home(keys)
        pending = np.arange(keys.size)
        while pending.size:
            at = slots[pending]
            free = self._index[at] == EMPTY
            self._index[at[free]] = rows[pending[free]]
            won = free & (self._index[at] == rows[pending])
            pending = pending[~won]
            slots[pending] = self._next(slots[pending])

    def _home(self, keys: np.ndarray) -> np.ndarray:
        """Each key's first slot: the low 32 bits of its hash scaled to the index size."""
        return (((mix(keys) & _LOW32) * np.uint64(self._index.size)) >> np.uint64(32)).astype(np.int64)

    def _next(self, slots: np.ndarray) -> np.ndarray:
        following = slots + 1
        following[following == self._index.size] = 0
        return following

    # -- expiry and state ----------------------------------------------------------------

    def expire(self, now: float) -> int:
        """Drop the rows last pushed to more than expire_after seconds ago; how many went."""
        if self.expire_after is None or self.n == 0:
            return 0
        keep = self.touched[: self.n] >= now - self.expire_after
        dropped = self.n - int(keep.sum())
        if dropped:
            self._compact(keep)
        return dropped

    def _compact(self, keep: np.ndarray) -> None:
        """Move the kept rows down over the dropped ones, in place and a chunk at a time (a
        copy of the whole table would double its memory), then rebuild the index."""
        kept = 0
        for start in range(0, self.n, CHUNK):
            chosen = start + np.flatnonzero(keep[start:start + CHUNK])
            for name in ROW_ARRAYS:  # rows only move down: a chunk never overwrites one not yet read
                array = getattr(self, name)
                array[kept:kept + chosen.size] = array[chosen]
            kept += chosen.size
        self.n = kept
        self._resize(max(MIN_ROWS, kept + kept // GROWTH))  # the freed tail goes back to the system
        self._rebuild_index(kept)

    def load(self, keys: np.ndarray, values: np.ndarray, accumulators: np.ndarray, touched: np.ndarray) -> None:
        """Replace every row (a restore, or the survivors of an expiry); none is dirty after."""
        n = keys.size
        capacity = max(MIN_ROWS, n)
        self.keys = _filled(np.int64, (capacity,), keys)
        self.values = _filled(np.float32, (capacity, self.dim), values)
        self.accumulators = _filled(np.float32, (capacity,), accumulators)
        self.touched = _filled(np.uint32, (capacity,), np.round(touched))
        self.dirty = np.zeros(capacity, dtype=bool)
        self.n = n
        self._rebuild_index(n)

    def put(self, keys: np.ndarray, values: np.ndarray, accumulators: np.ndarray, touched: np.ndarray) -> None:
        """Set the rows of keys (unique) as given, creating the missing ones (a delta's rows)."""
        index = self.lookup(keys)
        missing = index < 0
        index[missing] = self._create(keys[missing])
        self.values[index], self.accumulators[index] = values, accumulators
        self.touched[index] = np.round(touched)

    def clean(self) -> None:
        """Mark every row as saved: dirty flags count from here."""
        self.dirty[: self.n] = False

    def nbytes(self) -> int:
        """Memory held by the rows and the index (what a shard's RSS follows)."""
        arrays = [getattr(self, name) for name in ROW_ARRAYS] + [self._index]
        return sum(a.nbytes for a in arrays) + (0 if self.counts is None else self.counts.nbytes)


def _filled(dtype: type, shape: tuple[int, ...], data: np.ndarray) -> np.ndarray:
    array = np.empty(shape, dtype=dtype)
    array[: len(data)] = data
    return array


def _index_size(rows: int) -> int:
    return max(2 * MIN_ROWS, int(rows / MIN_LOAD) + 1)
