"""A job's shard checkpoints re-cut for another shard count, embedding rows included.

The dense state is re-cut by shard/reshard.py. A row belongs to the shard its key hashes to
(wire/rowkeys.owner_of), so with another count each row moves whole to its new owner, with
every state of its own: values, Adagrad accumulator, wide accumulator, occurrences, the
second of its last push. Two states are the old shard's rather than the row's:
- lazy L2 counts a row's penalty from the shard step of its last push (`stepped`): it is
  carried as the steps since then, counted back from the new checkpoints' step;
- the admission counters are a sketch shared by all keys not yet admitted, and cannot be
  split by key: each new shard gets their sum over the old shards. No key's count falls,
  so a key is admitted no later than it would have been (at most earlier, as two keys
  sharing a counter are).

The new checkpoints hold their rows among their arrays, the whole-table form; a shard whose
table outgrows that form writes a base of its own at its next checkpoint. Every old
shard's rows are read before the new ones are laid: about twice the table's memory.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.params.rows import rowtable
from distbelief.runtime.params.rows.rowcheckpoint import STATE_PREFIX, Rows, arrays_of, saved_parts
from distbelief.runtime.shard import checkpoint, reshard
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.rowkeys import owner_of

ROWS = "sparse"  # what the rows' arrays and metadata are named from
DIM, WIDE, ADMISSION = "sparseDim", "sparseWide", STATE_PREFIX + "admission"


@dataclasses.dataclass
class ShardRows:
    """One old shard's rows, every file of its chain applied, and its admission counters."""

    rows: Rows
    extra: dict[str, np.ndarray]
    admission: np.ndarray | None


def recut(old: Sequence[checkpoint.Checkpoint], folders: Sequence[str], before: Layout,
          after: Layout) -> Iterator[reshard.Recut]:
    """The checkpoints of `after`'s shards holding exactly the state of `old` (one per shard
    of `before`, in order, each read from its folder in `folders`, where its row files are),
    in shard order. Each one's rows are laid in buffers the next one reuses: write it before
    taking the next. ReshardError, raised before any is given, names what cannot be re-cut."""
    if not any(DIM in ckpt.meta for ckpt in old):
        return iter(reshard.recut(old, before, after))
    dim, wide = _row_shape(old)
    saved = [_shard_rows(ckpt, folder, dim, old[0].step) for ckpt, folder in zip(old, folders)]
    _check_alike(saved)
    new = reshard.recut([_without_rows(ckpt) for ckpt in old], before, after)
    # One base for every new shard's last-push seconds: each old shard's rows are laid as
    # checkpoint arrays once, and each new shard's gathered from those.
    touch_base = min((float(shard.rows[3].min()) for shard in saved if shard.rows[3].size), default=0.0)
    owners = [owner_of(shard.rows[0], after.shards) for shard in saved]
    laid = [arrays_of(shard.rows, shard.extra, touch_base)[0] for shard in saved]
    admission = _summed(saved)
    for recut in new:
        recut.header.meta.update({DIM: dim, WIDE: wide, "sparseTouchBase": touch_base})
        if admission is not None:
            recut.pieces[ADMISSION] = [admission]
    return _with_rows(new, owners, laid)


def _with_rows(new: list[reshard.Recut], owners: list[np.ndarray],
               laid: list[dict[str, np.ndarray]]) -> Iterator[reshard.Recut]:
    """Each new shard with its rows gathered from every old shard's, into one buffer per
    array that every new shard reuses: fresh memory is costly to fault in, and a table's
    rows are most of a job's state."""
    mine = [[np.flatnonzero(owner == recut.header.shard) for owner in owners] for recut in new]
    most = max(sum(rows.size for rows in shard) for shard in mine)
    buffers = {name: np.empty((most, *array.shape[1:]), array.dtype) for name, array in laid[0].items()}
    for recut, rows_of_old in zip(new, mine):
        count = sum(rows.size for rows in rows_of_old)
        for name, buffer in buffers.items():
            start = 0
            for arrays, rows in zip(laid, rows_of_old):
                np.take(arrays[name], rows, axis=0, out=buffer[start:start + rows.size], mode="clip")  # clip: not buffered
                start += rows.size
            recut.pieces[STATE_PREFIX + name] = [buffer[:count]]
        recut.header.meta["sparseRows"] = count
        yield recut


def _row_shape(old: Sequence[checkpoint.Checkpoint]) -> tuple[int, int]:
    shapes = {(int(ckpt.meta.get(DIM, 0)), int(ckpt.meta.get(WIDE, 0))) for ckpt in old}
    if len(shapes) != 1:
        raise errors.ReshardError(f"the shards' embedding rows differ in shape (sparseDim, sparseWide): {sorted(shapes)}")
    ((dim, wide),) = shapes
    return dim, wide


def _shard_rows(ckpt: checkpoint.Checkpoint, folder: str, dim: int, step: int) -> ShardRows:
    """A shard's rows as its checkpoint restores them (a delta's row replaces the base's), with
    lazy L2's step of each row's last push moved to count back from `step`."""
    try:
        parts = list(saved_parts(ckpt, folder, dim))
    except errors.CorruptCheckpoint as exc:
        raise errors.ReshardError(f"shard {ckpt.shard}'s rows in {folder}: {exc}") from exc
    names = {frozenset(extra) for _, extra in parts}
    if len(names) != 1:
        raise errors.ReshardError(f"shard {ckpt.shard}'s row files differ in the arrays they hold: {sorted(map(sorted, names))}")
    (rows, extra), *deltas = parts
    if deltas:  # a key in several files: its last one holds the row
        rows = tuple(np.concatenate([part[0][i] for part in parts]) for i in range(4))  # type: ignore[assignment]
        extra = {name: np.concatenate([part[1][name] for part in parts]) for name in extra}
        _, newest_first = np.unique(rows[0][::-1], return_index=True)
        last = rows[0].size - 1 - newest_first
        rows = tuple(array[last] for array in rows)  # type: ignore[assignment]
        extra = {name: array[last] for name, array in extra.items()}
    stepped = extra.get(rowtable.STEPPED)
    if stepped is not None:  # held unsigned: a shard ahead of `step` by d loses up to d steps of a row pushed in its first d
        extra[rowtable.STEPPED] = np.maximum(stepped.astype(np.float64) + (step - ckpt.step), 0.0)
    return ShardRows(rows, extra, ckpt.arrays.get(ADMISSION))


def _check_alike(saved: list[ShardRows]) -> None:
    """Every shard's rows carry the same optional arrays and admission counters (a job's
    spec.model.embeddings changed between the shards' checkpoints: they cannot be merged)."""
    kinds = [(sorted(shard.extra), None if shard.admission is None else shard.admission.size) for shard in saved]
    if any(kind != kinds[0] for kind in kinds):
        described = "; ".join(f"shard {index}: {', '.join(extra) or 'no optional arrays'}, "
                              f"{'no' if counters is None else counters} admission counters"
                              for index, (extra, counters) in enumerate(kinds))
        raise errors.ReshardError(f"the shards' rows differ in the state they carry ({described})")


def _without_rows(ckpt: checkpoint.Checkpoint) -> checkpoint.Checkpoint:
    return dataclasses.replace(ckpt, arrays={k: v for k, v in ckpt.arrays.items() if not k.startswith(ROWS)},
                               meta={k: v for k, v in ckpt.meta.items() if not k.startswith(ROWS)})


def _summed(saved: list[ShardRows]) -> np.ndarray | None:
    """The shards' admission counters added up (every shard has them, or none: _check_alike)."""
    counters = [shard.admission for shard in saved if shard.admission is not None]
    return np.add.reduce(np.stack(counters), dtype=np.float64).astype(np.float32) if counters else None
