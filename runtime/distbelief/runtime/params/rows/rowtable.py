"""A table of embedding rows keyed by 63-bit keys, over numpy arrays: the sparse shard's state.

    lookup(keys)           -> row index per key, -1 where the key has no row
    rows(keys)             -> the rows' values; a key without a row gets its initial value
    update(keys, grads, now, occurrences, step)
                           SGD or row-wise Adagrad (lazy L2) on the rows that exist or are admitted
    expire(now)            drops the rows not pushed to for expire_after seconds

Layout. The rows live in arrays appended in creation order: keys int64 [n], values float32
[n, dim], one Adagrad accumulator float32 [n], the second of the last push uint32 [n] and a
changed-since-the-last-checkpoint flag bool [n]: 81 bytes a row at dim 16 (and the optional
arrays below: 4 + 4 + 2 bytes). An open-addressing index (linear probing) maps a key to its
row: int32 row numbers only (the key is read from the rows), at a load factor between
MIN_LOAD and MAX_LOAD (1/2 to 3/4: 5.3 to 8 bytes a row). The row arrays grow by GROWTH
(1/8) in place (ndarray.resize: realloc, which moves pages instead of copying them), so
growing never holds two copies of the table and at most 1/8 of it is slack; the index is
rebuilt, larger, when it passes MAX_LOAD (the old index is dropped first). Keeping rows
apart from the index makes expiry a compaction followed by an index rebuild (no tombstones)
and a checkpoint the first n rows as they are. Probing is vectorised: every pending key
moves one slot per round, so a batch costs a few numpy passes, with no per-row Python loop.
Memory follows the rows that exist, never the id space.

Optimizer. spec.training.optimizer: plain SGD, or Adagrad, row-wise as TorchRec's: one
accumulator per row holding the mean of the squared gradient over the row's elements. It
keeps 1/dim of per-element Adagrad's state (at dim 16, 4 bytes a row, not 64): the table is
almost only its values; the elements of one embedding row see the same examples and have
gradients of similar scale, so one rate per row loses little.

The wide part. The last `wide` values of a row are the id's linear weights, added to the
model's logits (embedding.py). Their gradients are on another scale than the embedding's,
so they keep an accumulator of their own (wide_accumulators): in a shared one they would
take steps about sqrt(dim) times the learning rate, and the embedding values much smaller
ones (docs/benchmarks.md). They start at 0, as logistic regression's weights do.

L2, lazily. With l2 (embedding values) or wide_l2 (wide values), a row is pulled to 0 as if
every step had added l2 * value to its gradient (spec.model.l2's penalty on the dense
weights): a push adds l2 * value * (shard steps since the row's last push, `stepped`).
Rare ids, pushed once an epoch, stay near 0 unless their examples agree.

Embedding values in use. With embed_after > 1, a row's embedding values are read as 0 (as
a missing id's) and not trained until its key has occurred embed_after times since the row
was made (occurrences, uint16, 2 bytes a row); its wide values learn from the first. The
deep part then sees only ids with enough examples to learn from, while every id's own
weight learns as logistic regression's does: an embedding and an MLP given ids seen once or
twice memorise their examples (docs/benchmarks.md). A key without a row reads all 0.

The row budget. With max_rows, the table never holds more rows: when a push's new rows do
not fit, a table with expire_after evicts the rows pushed to least recently (the expiry
policy, early; 1/EVICT_SLACK of the budget more, to share a compaction among many pushes);
a table without it creates what fits and refuses the rest (their gradients dropped, as a
not yet admitted key's). Both are counted (evicted, refused).

Initial values are a counter-based hash of (key, seed, element) turned into a uniform in
[-INIT_SCALE, INIT_SCALE) (wide values: 0): any shard, replica or restart computes them.

Admission. A key gets a row once it has occurred admit_after times: an occurrence is one
appearance of the id in a training example whose gradient a replica pushed (a minibatch
with the id in 5 examples counts 5). The push that brings the count to admit_after creates
the row and is applied to it; the gradients of the pushes before are dropped. Counts live
in a fixed array of COUNTERS counters indexed by key hash (bounded memory; two keys
sharing a counter are admitted a little early).
"""

from __future__ import annotations

from typing import Mapping

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
EVICT_SLACK = 16              # at the budget, evict 1/EVICT_SLACK of it beyond what the push needs
ROW_ARRAYS = ("keys", "values", "accumulators", "touched", "dirty")
# Arrays a table has only with the wide part (wide > 0), with L2 (l2 or wide_l2 > 0), or with
# embed_after > 1.
WIDE_ACCUMULATORS, STEPPED, OCCURRENCES = "wide_accumulators", "stepped", "occurrences"
OPTIONAL_ARRAYS = {WIDE_ACCUMULATORS: np.float32, STEPPED: np.uint32, OCCURRENCES: np.uint16}
MAX_EMBED_AFTER = int(np.iinfo(np.uint16).max)
_LOW32 = np.uint64(0xFFFFFFFF)


def initial_rows(keys: np.ndarray, dim: int, seed: int, wide: int = 0) -> np.ndarray:
    """Each key's initial row: uniform in [-INIT_SCALE, INIT_SCALE), deterministic in (key,
    seed); the last `wide` values 0."""
    base = mix(keys.astype(np.uint64) ^ mix(np.array([seed], dtype=np.uint64)))
    counters = base[:, None] + np.arange(1, dim + 1, dtype=np.uint64)[None, :] * GOLDEN
    unit = (mix(counters) >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)
    rows = (unit * np.float32(2 * INIT_SCALE) - np.float32(INIT_SCALE)).astype(np.float32)
    if wide:
        rows[:, dim - wide:] = 0.0
    return rows


class RowTable:
    def __init__(self, dim: int, *, learning_rate: float, seed: int, admit_after: int = 1,
                 expire_after: float | None = None, wide: int = 0, l2: float = 0.0, wide_l2: float = 0.0,
                 embed_after: int = 1, max_rows: int | None = None, optimizer: str = "adagrad") -> None:
        """dim: values per row, of which the last `wide` are the id's linear weights (the wide
        part); l2 and wide_l2: the lazy L2 weights of the embedding and the wide values;
        embed_after: the occurrences of a row's key before its embedding values are read and
        trained; max_rows: the row budget (None: none)."""
        if not 0 <= wide < dim:
            raise ValueError(f"a row of {dim} values cannot hold {wide} wide values beside an embedding")
        if not 1 <= embed_after <= MAX_EMBED_AFTER:
            raise ValueError(f"embed_after must be within 1..{MAX_EMBED_AFTER}")
        self.dim, self.seed, self.wide, self.embed_after = dim, seed, wide, embed_after
        self.max_rows, self.sgd = max_rows, optimizer == "sgd"  # else adagrad (the CRD's enum)
        self.refused = 0   # rows not created for want of room (max_rows without expire_after)
        self.evicted = 0   # rows evicted to make room (max_rows with expire_after)
        self.learning_rate = np.float32(learning_rate)
        self.admit_after = admit_after
        self.expire_after = expire_after
        self.l2 = np.array([l2] * (dim - wide) + [wide_l2] * wide, dtype=np.float32)  # per value of a row
        self.step = 0  # the shard step of the last update (what rows loaded without their own count from)
        self.n = 0
        self.keys = np.empty(MIN_ROWS, dtype=np.int64)
        self.values = np.empty((MIN_ROWS, dim), dtype=np.float32)
        self.accumulators = np.empty(MIN_ROWS, dtype=np.float32)
        self.touched = np.empty(MIN_ROWS, dtype=np.uint32)   # whole seconds of the Unix epoch
        self.dirty = np.zeros(MIN_ROWS, dtype=bool)          # changed since clean() (incremental checkpoints)
        self.wide_accumulators = np.empty(MIN_ROWS, dtype=np.float32) if wide else None
        self.stepped = np.empty(MIN_ROWS, dtype=np.uint32) if self.l2.any() else None  # shard step of the last push
        # occurrences of the row's key since its creation, up to embed_after
        self.occurrences = np.empty(MIN_ROWS, dtype=np.uint16) if embed_after > 1 else None
        self.row_arrays = ROW_ARRAYS + tuple(name for name in OPTIONAL_ARRAYS if getattr(self, name) is not None)
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
        """The current rows of keys (a copy); a key without a row gets its initial value. With
        embed_after > 1, the embedding values of a key that has not occurred that often read 0."""
        index = self.lookup(keys)
        out = np.empty((keys.size, self.dim), dtype=np.float32)
        present = index >= 0
        out[present] = self.values[index[present]]
        if self.occurrences is not None:
            cold = ~present
            cold[present] = self.occurrences[index[present]] < self.embed_after
            out[cold, :self.dim - self.wide] = 0.0
            out[~present, self.dim - self.wide:] = 0.0  # the wide values' initial value
        elif not present.all():
            out[~present] = initial_rows(keys[~present], self.dim, self.seed, self.wide)
        return out

    # -- writing -------------------------------------------------------------------------

    def update(self, keys: np.ndarray, grads: np.ndarray, now: float, occurrences: np.ndarray | None = None,
               step: int | None = None) -> int:
        """The optimizer's step on the rows of keys (unique), creating the admitted ones; returns
        how many rows were updated. occurrences: how many times each key occurred in the
        pushed examples (None: once each); a key not yet admitted is only counted. step: the
        shard's step now, which lazy L2 counts from (None: the last one given)."""
        if step is not None:
            self.step = step
        index = self.lookup(keys)
        missing = index < 0
        if missing.any():
            counted = None if occurrences is None else occurrences[missing]
            admitted = np.flatnonzero(missing)[self._admit(keys[missing], counted)]
            if self.max_rows is not None and self.n + admitted.size > self.max_rows:
                admitted, index = self._make_room(keys, index, admitted, now)
            index[admitted] = self._create(keys[admitted])
        live = index >= 0
        rows, g = index[live], grads[live]
        if self.stepped is not None:  # lazy L2: the penalty of every step since the row's last push
            since = np.maximum(np.int64(self.step) - self.stepped[rows], 1).astype(np.float32)
            g = g + self.values[rows] * since[:, None] * self.l2
            self.stepped[rows] = self.step
        if self.occurrences is not None:  # embedding values not in use yet: only counted
            before = self.occurrences[rows]
            counted = np.ones(rows.size, np.int64) if occurrences is None else occurrences[live]
            self.occurrences[rows] = np.minimum(before + counted, self.embed_after)
            cold = before < self.embed_after
            if cold.any():
                g[cold, :self.dim - self.wide] = 0.0
        self.values[rows] -= g * self.learning_rate if self.sgd else self._adagrad(rows, g)
        self.touched[rows] = int(now)
        self.dirty[rows] = True
        return int(rows.size)

    def _adagrad(self, rows: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Row-wise Adagrad's step for some rows (their accumulators updated): the embedding
        values and the wide values each with their own accumulator."""
        deep = self.dim - self.wide
        embedding = g[:, :deep] if self.wide else g
        acc = self.accumulators[rows] + np.mean(embedding * embedding, axis=1)
        self.accumulators[rows] = acc
        step = g * (self.learning_rate / (np.sqrt(acc) + np.float32(EPSILON)))[:, None]
        if self.wide:
            linear = g[:, deep:]
            acc = self.wide_accumulators[rows] + np.mean(linear * linear, axis=1)
            self.wide_accumulators[rows] = acc
            step[:, deep:] = linear * (self.learning_rate / (np.sqrt(acc) + np.float32(EPSILON)))[:, None]
        return step

    def _make_room(self, keys: np.ndarray, index: np.ndarray, admitted: np.ndarray,
                   now: float) -> tuple[np.ndarray, np.ndarray]:
        """At the budget: evict the rows pushed to least recently (with expire_after), or keep
        of the admitted keys only those that fit. Returns the admitted keys that get rows and
        the rows of the push's keys (they move when rows are evicted)."""
        assert self.max_rows is not None
        if self.expire_after is None or admitted.size > self.max_rows:
            fits = max(0, self.max_rows - self.n)
            self.refused += admitted.size - fits
            return admitted[:fits], index
        wanted = min(self.n, self.n + admitted.size - self.max_rows + self.max_rows // EVICT_SLACK)
        touched = self.touched[: self.n].astype(np.int64)
        touched[index[index >= 0]] = np.iinfo(np.int64).max  # the push's own rows stay
        keep = np.ones(self.n, dtype=bool)
        keep[np.argpartition(touched, wanted - 1)[:wanted]] = False
        self._compact(keep)
        self.evicted += wanted
        return admitted, self.lookup(keys)

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
        self.values[rows] = initial_rows(keys, self.dim, self.seed, self.wide)
        self.accumulators[rows] = 0.0
        if self.wide_accumulators is not None:
            self.wide_accumulators[rows] = 0.0
        if self.stepped is not None:
            self.stepped[rows] = self.step
        if self.occurrences is not None:
            self.occurrences[rows] = 0
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
        for name in self.row_arrays:  # in place: no other reference to these arrays outlives a request
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
            for name in self.row_arrays:  # rows only move down: a chunk never overwrites one not yet read
                array = getattr(self, name)
                array[kept:kept + chosen.size] = array[chosen]
            kept += chosen.size
        self.n = kept
        self._resize(max(MIN_ROWS, kept + kept // GROWTH))  # the freed tail goes back to the system
        self._rebuild_index(kept)

    def load(self, keys: np.ndarray, values: np.ndarray, accumulators: np.ndarray, touched: np.ndarray,
             extra: Mapping[str, np.ndarray] | None = None) -> None:
        """Replace every row (a restore, or the survivors of an expiry); none is dirty after.
        extra: the optional arrays by name (wide_accumulators, stepped); one not given starts
        at 0 (an accumulator) or at the table's step (stepped)."""
        n = keys.size
        capacity = max(MIN_ROWS, n)
        self.keys = _filled(np.int64, (capacity,), keys)
        self.values = _filled(np.float32, (capacity, self.dim), values)
        self.accumulators = _filled(np.float32, (capacity,), accumulators)
        self.touched = _filled(np.uint32, (capacity,), np.round(touched))
        self.dirty = np.zeros(capacity, dtype=bool)
        for name, dtype in OPTIONAL_ARRAYS.items():
            if getattr(self, name) is not None:
                setattr(self, name, _filled(dtype, (capacity,), self._extra(extra, name, n)))
        self.n = n
        self._rebuild_index(n)

    def put(self, keys: np.ndarray, values: np.ndarray, accumulators: np.ndarray, touched: np.ndarray,
            extra: Mapping[str, np.ndarray] | None = None) -> None:
        """Set the rows of keys (unique) as given, creating the missing ones (a delta's rows)."""
        index = self.lookup(keys)
        missing = index < 0
        index[missing] = self._create(keys[missing])
        self.values[index], self.accumulators[index] = values, accumulators
        self.touched[index] = np.round(touched)
        for name in OPTIONAL_ARRAYS:
            array = getattr(self, name)
            if array is not None:
                array[index] = self._extra(extra, name, keys.size)

    def _extra(self, extra: Mapping[str, np.ndarray] | None, name: str, n: int) -> np.ndarray:
        given = (extra or {}).get(name)
        if given is not None:
            return given if name == WIDE_ACCUMULATORS else np.round(given)
        # Rows saved without it: their L2 counts from now; their embedding values are in use
        # (a table saved without counts used every row's).
        default = {STEPPED: self.step, OCCURRENCES: self.embed_after}.get(name, 0)
        return np.full(n, default, dtype=np.float64)

    def clean(self) -> None:
        """Mark every row as saved: dirty flags count from here."""
        self.dirty[: self.n] = False

    def row_bytes(self) -> float:
        """The most bytes one row takes: its arrays' share with the growth slack, and the
        index's at its lowest load."""
        arrays = sum(getattr(self, name).itemsize * (self.dim if name == "values" else 1) for name in self.row_arrays)
        return arrays * (1 + 1 / GROWTH) + np.dtype(np.int32).itemsize / MIN_LOAD

    def nbytes(self) -> int:
        """Memory held by the rows and the index (what a shard's RSS follows)."""
        arrays = [getattr(self, name) for name in self.row_arrays] + [self._index]
        return sum(a.nbytes for a in arrays) + (0 if self.counts is None else self.counts.nbytes)


def _filled(dtype: type, shape: tuple[int, ...], data: np.ndarray) -> np.ndarray:
    array = np.empty(shape, dtype=dtype)
    array[: len(data)] = data
    return array


def _index_size(rows: int) -> int:
    return max(2 * MIN_ROWS, int(rows / MIN_LOAD) + 1)
