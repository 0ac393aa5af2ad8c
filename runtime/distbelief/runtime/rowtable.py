"""A table of embedding rows keyed by 63-bit keys, over numpy arrays: the sparse shard's state.

    lookup(keys)           -> row index per key, -1 where the key has no row
    rows(keys)             -> the rows' values; a key without a row gets its initial value
    update(keys, grads)    row-wise Adagrad on the rows that exist or are admitted now
    expire(now)            drops the rows not pushed to for expire_after seconds

Layout. An open-addressing index (linear probing, power-of-two capacity, load <= 1/2;
int64 keys, int32 row numbers) maps a key to its row; the rows themselves live in dense
arrays, appended in creation order and grown by doubling: keys int64 [n], values float32 [n, dim], one
Adagrad accumulator float32 [n], the wall time of the last push float64 [n]. Keeping rows
apart from the index makes growth a cheap re-insert of int64 keys (the rows are copied
once by the doubling), makes expiry a compaction followed by an index rebuild (no
tombstones), and makes a checkpoint the first n rows as they are. Probing is vectorised:
every pending key moves one slot per round, so a batch costs a few numpy passes, with no
per-row Python loop. Memory follows the rows that exist, never the id space.

Optimizer. Adagrad is row-wise, as TorchRec's: one accumulator per row holding the mean
of the squared gradient over the row's elements. It keeps 1/dim of per-element Adagrad's
optimizer state (at dim 16, 4 bytes per row instead of 64), so the table's memory is
almost only its values; the elements of one embedding row see the same examples and have
gradients of similar scale, so one rate per row loses little.

Initial values are a counter-based hash of (key, seed, element) turned into a uniform in
[-INIT_SCALE, INIT_SCALE): any shard, replica or restart computes the same row without
storing or sending it. Admission counts live in a fixed array of counters indexed by key
hash (bounded memory; two keys sharing a counter are admitted a little early).
"""

from __future__ import annotations

import numpy as np

EMPTY = np.int64(-1)          # an index slot without a key (valid keys are >= 0)
INIT_SCALE = 0.05
EPSILON = 1e-8
MIN_ROWS = 1024
COUNTERS = 1 << 20            # admission counters (4 MiB), shared by all not-yet-admitted keys
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix(keys: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over an array: a well-spread 64-bit hash of each value."""
    z = keys.astype(np.uint64, copy=True)
    z += _GOLDEN
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def initial_rows(keys: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """Each key's initial row: uniform in [-INIT_SCALE, INIT_SCALE), deterministic in (key, seed)."""
    base = mix(keys.astype(np.uint64) ^ mix(np.array([seed], dtype=np.uint64)))
    counters = base[:, None] + np.arange(1, dim + 1, dtype=np.uint64)[None, :] * _GOLDEN
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
        self.touched = np.empty(MIN_ROWS, dtype=np.float64)
        self._slot_keys = np.full(2 * MIN_ROWS, EMPTY, dtype=np.int64)
        self._slot_rows = np.empty(2 * MIN_ROWS, dtype=np.int32)  # rows per shard < 2**31
        self.counts = np.zeros(COUNTERS, dtype=np.uint32) if admit_after > 1 else None

    # -- reading -------------------------------------------------------------------------

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The row index of each key, -1 for a key without a row."""
        found = np.full(keys.size, -1, dtype=np.int64)
        mask = np.uint64(self._slot_keys.size - 1)
        slots = (mix(keys) & mask).astype(np.int64)
        pending = np.arange(keys.size)
        while pending.size:
            at = slots[pending]
            held = self._slot_keys[at]
            hit = held == keys[pending]
            found[pending[hit]] = self._slot_rows[at[hit]]
            pending = pending[~hit & (held != EMPTY)]
            slots[pending] = (slots[pending] + 1) & int(mask)
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

    def update(self, keys: np.ndarray, grads: np.ndarray, now: float) -> int:
        """Row-wise Adagrad on the rows of keys (unique), creating the admitted ones; returns
        how many rows were updated (a key not yet admitted is only counted)."""
        index = self.lookup(keys)
        missing = index < 0
        if missing.any():
            admitted = np.flatnonzero(missing)[self._admit(keys[missing])]
            index[admitted] = self._create(keys[admitted])
        live = index >= 0
        rows, g = index[live], grads[live]
        acc = self.accumulators[rows] + np.mean(g * g, axis=1)
        self.accumulators[rows] = acc
        scale = self.learning_rate / (np.sqrt(acc) + np.float32(EPSILON))
        self.values[rows] -= g * scale[:, None]
        self.touched[rows] = now
        return int(rows.size)

    def _admit(self, keys: np.ndarray) -> np.ndarray:
        """Which of these keys (without rows) have now occurred admit_after times."""
        if self.counts is None:
            return np.ones(keys.size, dtype=bool)
        counters = (mix(keys) >> np.uint64(44)).astype(np.int64) % COUNTERS
        np.add.at(self.counts, counters, 1)
        return self.counts[counters] >= self.admit_after

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
                capacity *= 2
            for name in ("keys", "values", "accumulators", "touched"):
                old = getattr(self, name)
                grown = np.empty((capacity, *old.shape[1:]), dtype=old.dtype)
                grown[: self.n] = old[: self.n]
                setattr(self, name, grown)
        if 2 * rows > self._slot_keys.size:
            self._rebuild_index(max(2 * self._slot_keys.size, _power_of_two(2 * rows)))

    def _rebuild_index(self, slots: int) -> None:
        self._slot_keys = np.full(slots, EMPTY, dtype=np.int64)
        self._slot_rows = np.empty(slots, dtype=np.int32)
        self._insert(self.keys[: self.n], np.arange(self.n))

    def _insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Put keys (unique, absent) into the index. Keys probing to the same free slot in
        one round all write it; the one whose key stays there has it, the others probe on."""
        mask = self._slot_keys.size - 1
        slots = (mix(keys) & np.uint64(mask)).astype(np.int64)
        pending = np.arange(keys.size)
        while pending.size:
            at = slots[pending]
            free = self._slot_keys[at] == EMPTY
            self._slot_keys[at[free]] = keys[pending[free]]
            won = free & (self._slot_keys[at] == keys[pending])
            self._slot_rows[at[won]] = rows[pending[won]]
            pending = pending[~won]
            slots[pending] = (slots[pending] + 1) & mask

    # -- expiry and state ----------------------------------------------------------------

    def expire(self, now: float) -> int:
        """Drop the rows last pushed to more than expire_after seconds ago; how many went."""
        if self.expire_after is None or self.n == 0:
            return 0
        keep = self.touched[: self.n] >= now - self.expire_after
        dropped = self.n - int(keep.sum())
        if dropped:
            self.load(self.keys[: self.n][keep], self.values[: self.n][keep],
                      self.accumulators[: self.n][keep], self.touched[: self.n][keep])
        return dropped

    def load(self, keys: np.ndarray, values: np.ndarray, accumulators: np.ndarray, touched: np.ndarray) -> None:
        """Replace every row (a restore, or the survivors of an expiry)."""
        keys, values = np.array(keys, dtype=np.int64), np.array(values, dtype=np.float32)
        accumulators, touched = np.array(accumulators, dtype=np.float32), np.array(touched, dtype=np.float64)
        capacity = max(MIN_ROWS, _power_of_two(keys.size))
        self.keys = np.resize(keys, capacity)
        self.values = np.resize(values, (capacity, self.dim))
        self.accumulators = np.resize(accumulators, capacity)
        self.touched = np.resize(touched, capacity)
        self.n = keys.size
        self._rebuild_index(max(2 * MIN_ROWS, _power_of_two(2 * keys.size)))

    def nbytes(self) -> int:
        """Memory held by the rows and the index (what a shard's RSS follows)."""
        arrays = (self.keys, self.values, self.accumulators, self.touched, self._slot_keys, self._slot_rows)
        return sum(a.nbytes for a in arrays) + (0 if self.counts is None else self.counts.nbytes)


def _power_of_two(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())
