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
from typing import Any, Sequence

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
          after: Layout) -> list[reshard.Recut]:
    """The checkpoints of `after`'s shards holding exactly the state of `old` (one per shard
    of `before`, in order, each read from its folder in `folders`, where its row files are).
    ReshardError names what cannot be re-cut."""
    if not any(DIM in ckpt.meta for ckpt in old):
        return reshard.recut(old, before, after)
    dim, wide = _row_shape(old)
    saved = [_shard_rows(ckpt, folder, dim, old[0].step) for ckpt, folder in zip(old, folders)]
    new = reshard.recut([_without_rows(ckpt) for ckpt in old], before, after)
    owners = [owner_of(shard.rows[0], after.shards) for shard in saved]
    admission = _summed([shard.admission for shard in saved])
    for recut in new:
        mine = [owner == recut.header.shard for owner in owners]
        rows: Rows = tuple(np.concatenate([shard.rows[i][m] for shard, m in zip(saved, mine)])  # type: ignore[assignment]
                           for i in range(4))
        extra = {name: np.concatenate([shard.extra[name][m] for shard, m in zip(saved, mine)])
                 for name in saved[0].extra}
        arrays, touch_base = arrays_of(rows, extra)
        recut.pieces.update({STATE_PREFIX + name: [array] for name, array in arrays.items()})
        if admission is not None:
            recut.pieces[ADMISSION] = [admission]
        recut.header.meta.update({DIM: dim, WIDE: wide, "sparseRows": int(rows[0].size), "sparseTouchBase": touch_base})
    return new


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
    rows = tuple(np.concatenate([part[0][i] for part in parts]) for i in range(4))
    extra = {name: np.concatenate([part[1][name] for part in parts]) for name in parts[0][1]}
    _, newest_first = np.unique(rows[0][::-1], return_index=True)
    last = rows[0].size - 1 - newest_first
    stepped = extra.get(rowtable.STEPPED)
    if stepped is not None:
        extra[rowtable.STEPPED] = np.maximum(stepped.astype(np.float64) + (step - ckpt.step), 0.0)
    return ShardRows(tuple(array[last] for array in rows),  # type: ignore[arg-type]
                     {name: array[last] for name, array in extra.items()}, ckpt.arrays.get(ADMISSION))


def _without_rows(ckpt: checkpoint.Checkpoint) -> checkpoint.Checkpoint:
    return dataclasses.replace(ckpt, arrays={k: v for k, v in ckpt.arrays.items() if not k.startswith(ROWS)},
                               meta=_dense_meta(ckpt.meta))


def _dense_meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in meta.items() if not key.startswith(ROWS)}


def _summed(counters: list[np.ndarray | None]) -> np.ndarray | None:
    present = [c for c in counters if c is not None]
    if not present:
        return None
    return np.sum([c.astype(np.float64) for c in present], axis=0).astype(np.float32)
