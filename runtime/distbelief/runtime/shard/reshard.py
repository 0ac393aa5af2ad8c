"""A job's shard checkpoints re-cut for another shard count, bit for bit.

A dense shard's state is elementwise: its slice of the flat parameter vector, and per
value its optimizer's state (Adagrad's accumulators) and its algorithm's vectors. The
slices of the old shards, in order, are the flat vectors; the new layout cuts them again
(wire/layout.py: within each stage when the model is partitioned), each new slice written
from the pieces of the old ones it spans, without joining them. Every value lands
unchanged, so the model and optimizer state after a reshard are those before it.

The new checkpoints take the global step (shard 0's, the chief's) and shard 0's figures
(start time, examples, restarts, the job's uid); the peers' last commands are dropped: the
replicas start over on the new layout, and a resend of the old one is refused by its
layout hash. What cannot be re-cut is refused by name: metadata that differs between the
shards (a Sandblaster coordinator's state), a finished job, and embedding rows, which are
hashed to shards rather than cut (params/rows/rowrecut.py moves them, then calls this).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.resends import CHECKPOINT_KEY
from distbelief.runtime.wire.layout import Layout

# The core's figures (core.Shard.core_meta): taken from shard 0, not compared.
CORE_META = ("restarts", "startTime", "finished", "examples", checkpoint.JOB_UID, CHECKPOINT_KEY)
# Metadata of embedding rows (params/rows): their keys are hashed to shards, not cut.
ROWS_META = ("sparseDim", "sparseChain")
# A shard's own counters, which start again on the new layout: its journal's last command
# (the old journals go with the old folders; roles/reshard.py first refuses while one holds
# what its checkpoint does not).
RESTARTED_META = (checkpoint.JOURNAL_SEQ,)


@dataclasses.dataclass
class Recut:
    """A new shard's checkpoint: its step, layout, shard and metadata (no arrays), and its
    arrays as pieces of the old shards' (views, never joined: checkpoint.write takes them)."""

    header: checkpoint.Checkpoint
    pieces: checkpoint.Pieces


def recut(old: Sequence[checkpoint.Checkpoint], before: Layout, after: Layout) -> list[Recut]:
    """The checkpoints of `after`'s shards holding exactly the state of `old` (one checkpoint
    per shard of `before`, in shard order). ReshardError names what cannot be re-cut."""
    _check(old, before, after)
    meta = _carried_meta(old[0].meta)
    return [Recut(checkpoint.Checkpoint(step=old[0].step, layout=after.hash, shard=shard, arrays={}, meta=dict(meta)),
                  {name: _pieces(old, before, *after.bounds(shard), name) for name in old[0].arrays})
            for shard in range(after.shards)]


def _pieces(old: Sequence[checkpoint.Checkpoint], before: Layout, start: int, stop: int,
            name: str) -> list[np.ndarray | checkpoint.Gathered]:
    """The parts of the old shards' array `name` that hold the flat range [start, stop)."""
    pieces: list[np.ndarray | checkpoint.Gathered] = []
    for shard in before.shards_of(start, stop):
        low, high = before.bounds(shard)
        pieces.append(old[shard].arrays[name][max(start, low) - low:min(stop, high) - low])
    return pieces


def _check(old: Sequence[checkpoint.Checkpoint], before: Layout, after: Layout) -> None:
    if (before.shapes, before.stages) != (after.shapes, after.stages):
        raise errors.ReshardError("the new layout is of another model: only the shard count may change")
    if len(old) != before.shards:
        raise errors.ReshardError(f"{len(old)} checkpoints for {before.shards} shards")
    names = set(old[0].arrays)
    plugin_meta = _plugin_meta(old[0].meta)
    for shard, ckpt in enumerate(old):
        where = f"shard {shard}'s checkpoint (step {ckpt.step})"
        if (ckpt.layout, ckpt.shard) != (before.hash, shard):
            raise errors.ReshardError(f"{where} is of shard {ckpt.shard} of layout {ckpt.layout:016x}, "
                                      f"expected shard {shard} of {before.hash:016x}")
        if any(key in ckpt.meta for key in ROWS_META):
            raise errors.ReshardError(f"{where} holds embedding rows (spec.model.embeddings): "
                                      "re-hash them (params/rows/rowrecut.py), a dense re-cut does not carry them")
        if ckpt.meta.get("finished"):
            raise errors.ReshardError(f"{where}: the job has finished; there is nothing to resume")
        if set(ckpt.arrays) != names:
            raise errors.ReshardError(f"{where} holds arrays {sorted(ckpt.arrays)}, shard 0's "
                                      f"{sorted(names)}")
        uncut = [name for name, values in ckpt.arrays.items() if values.size != before.size(shard)]
        if uncut:
            raise errors.ReshardError(f"{where}: {', '.join(sorted(uncut))} not one value per parameter of "
                                      f"the slice ({before.size(shard)}), so not re-cut")
        differing = sorted(key for key in plugin_meta.keys() | _plugin_meta(ckpt.meta).keys()
                           if plugin_meta.get(key) != ckpt.meta.get(key))
        if differing:
            raise errors.ReshardError(f"{where}: {', '.join(differing)} differs from shard 0's, a state of "
                                      "the shard's own that a re-cut would not carry")


def _plugin_meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in meta.items() if key not in CORE_META + RESTARTED_META}


def _carried_meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in meta.items() if key != CHECKPOINT_KEY and key not in RESTARTED_META}
