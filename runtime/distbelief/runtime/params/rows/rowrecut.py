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
shard's rows are read (their files mapped: checkpoint.load without copy) before the new
ones are gathered, a chunk at a time, as each new checkpoint is written.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.params.rows.rowcheckpoint import (EXTRA, FIELDS, STATE_PREFIX, Rows, extra_of, key_parts,
                                                          keys_from_parts, rows_of, saved_files)
from distbelief.runtime.shard import checkpoint, reshard
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.rowkeys import owner_of

ROWS = "sparse"  # what the rows' arrays and metadata are named from
DIM, WIDE, ADMISSION = "sparseDim", "sparseWide", STATE_PREFIX + "admission"
TOUCHED, STEPPED = "touched", "stepped"  # the two arrays a re-cut changes, by their names in row files


@dataclasses.dataclass
class ShardRows:
    """One old shard's rows, every file of its chain applied, as a checkpoint lays them (by
    their names in row files: keys as key_parts, values [n, dim]), but for their last-push
    seconds, absolute until a base for every new shard is chosen; their keys; and the
    shard's admission counters."""

    laid: dict[str, np.ndarray]
    keys: np.ndarray
    admission: np.ndarray | None


def recut(old: Sequence[checkpoint.Checkpoint], folders: Sequence[str], before: Layout,
          after: Layout) -> Iterator[reshard.Recut]:
    """The checkpoints of `after`'s shards holding exactly the state of `old` (one per shard
    of `before`, in order, each read from its folder in `folders`, where its row files are),
    in shard order, each one's rows gathered as it is written. ReshardError, raised before
    any is given, names what cannot be re-cut."""
    if not any(DIM in ckpt.meta for ckpt in old):
        return iter(reshard.recut(old, before, after))
    dim, wide = _row_shape(old)
    saved = [_shard_rows(ckpt, folder, dim, old[0].step) for ckpt, folder in zip(old, folders)]
    _check_alike(saved)
    new = reshard.recut([_without_rows(ckpt) for ckpt in old], before, after)
    # One base for every new shard's last-push seconds: each old shard's rows are laid as
    # checkpoint arrays once, and each new shard's gathered from those.
    touch_base = min((float(shard.laid[TOUCHED].min()) for shard in saved if shard.keys.size), default=0.0)
    owners = [owner_of(shard.keys, after.shards) for shard in saved]
    laid = [{name: (array - touch_base if name == TOUCHED else array).astype(np.float32, copy=False)
             for name, array in shard.laid.items()} for shard in saved]
    admission = _summed(saved)
    for recut in new:
        recut.header.meta.update({DIM: dim, WIDE: wide, "sparseTouchBase": touch_base})
        if admission is not None:
            recut.pieces[ADMISSION] = [admission]
    return _with_rows(new, owners, laid)


def _with_rows(new: list[reshard.Recut], owners: list[np.ndarray],
               laid: list[dict[str, np.ndarray]]) -> Iterator[reshard.Recut]:
    """Each new shard with its rows gathered from every old shard's as its checkpoint is
    written (checkpoint.Gathered): a table's rows are most of a job's state, and memory
    fresh to the process is costly to fault in."""
    for recut in new:
        mine = [np.flatnonzero(owner == recut.header.shard) for owner in owners]
        for name in laid[0]:
            recut.pieces[STATE_PREFIX + name] = [checkpoint.Gathered(arrays[name], rows)
                                                 for arrays, rows in zip(laid, mine)]
        recut.header.meta["sparseRows"] = sum(rows.size for rows in mine)
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
        files = list(saved_files(ckpt, folder))
    except errors.CorruptCheckpoint as exc:
        raise errors.ReshardError(f"shard {ckpt.shard}'s rows in {folder}: {exc}") from exc
    names = {frozenset(extra_of(arrays)) for arrays, _ in files}
    if len(names) != 1:
        raise errors.ReshardError(f"shard {ckpt.shard}'s row files differ in the arrays they hold: {sorted(map(sorted, names))}")
    if len(files) == 1:  # as stored: only the last-push seconds change form
        arrays, touch_base = files[0]
        laid = {name: arrays[name] for name in (*FIELDS, *EXTRA) if name in arrays}
        laid["keys"], laid["values"] = laid["keys"].reshape(-1, 3), laid["values"].reshape(laid["accumulators"].size, dim)
        laid[TOUCHED] = laid[TOUCHED].astype(np.float64) + touch_base
        keys = keys_from_parts(laid["keys"])
    else:
        laid, keys = _merged([(rows_of([arrays[n] for n in FIELDS], dim, base), extra_of(arrays)) for arrays, base in files])
    if STEPPED in laid:  # held unsigned: a shard ahead of `step` by d loses up to d steps of a row pushed in its first d
        laid[STEPPED] = np.maximum(laid[STEPPED].astype(np.float64) + (step - ckpt.step), 0.0)
    return ShardRows(laid, keys, ckpt.arrays.get(ADMISSION))


def _merged(parts: list[tuple[Rows, dict[str, np.ndarray]]]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A base and its deltas as one set of rows (a key in several files: its last one holds
    the row), laid as _shard_rows lays them, and their keys."""
    rows = tuple(np.concatenate([part[0][i] for part in parts]) for i in range(4))
    extra = {name: np.concatenate([part[1][name] for part in parts]) for name in parts[0][1]}
    _, newest_first = np.unique(rows[0][::-1], return_index=True)
    last = rows[0].size - 1 - newest_first
    keys, values, accumulators, touched = (array[last] for array in rows)
    laid = {"keys": key_parts(keys), "values": values, "accumulators": accumulators, TOUCHED: touched}
    laid.update({name: extra[attribute][last] for name, attribute in EXTRA.items() if attribute in extra})
    return laid, keys


def _check_alike(saved: list[ShardRows]) -> None:
    """Every shard's rows carry the same optional arrays and admission counters (a job's
    spec.model.embeddings changed between the shards' checkpoints: they cannot be merged)."""
    kinds = [(sorted(EXTRA[name] for name in shard.laid if name in EXTRA),
              None if shard.admission is None else shard.admission.size) for shard in saved]
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
