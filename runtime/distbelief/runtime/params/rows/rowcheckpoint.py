"""A shard's embedding rows in its checkpoints: the whole table while it is small, a base
and deltas beyond.

A row costs (dim + 5) x 4 bytes in a checkpoint: its values, its Adagrad accumulator, the
second of its last push, and its key as three exact 21-bit float32 parts (checkpoints hold
float32 arrays only); with the wide part 4 bytes more (its accumulator), with L2 4 more
(the step of its last push, exact in float32 up to step 2**24 and within 2**-24 of it
beyond) and with embedAfter > 1 4 more (its occurrences so far). While a shard's rows take at most FULL_WRITE_BYTES (256 MiB: 3.2M
rows at dim 16), every checkpoint holds the whole table among the shard's arrays. Beyond
it, the rows go to files of their own in <checkpoint folder>/rows/:

    base-<step>-<tag>.rows    every row, at that step
    delta-<step>-<tag>.rows   the rows pushed to since the previous file of the chain

each in the checkpoint format (checkpoint.write: atomic, a SHA-256 over header and data).
The shard's checkpoint names the chain it stands on (a base, then its deltas, each with
its SHA-256) and is written after them, so a crash in between leaves only a file that no
checkpoint names (pruned by the next checkpoint) or a temporary (removed at restore). A
restore reads the chain in order and checks each file against the digest named: a file
missing, damaged or replaced is set aside as *.corrupt and raises CorruptCheckpoint, and
the shard falls back to its previous checkpoint, whose chain is still on disk: pruning
removes only files that no checkpoint in the folder (and not the chain in memory) names.
A new base is written (compaction) when the deltas since the last one reach MAX_DELTAS
or hold half as many rows as it, and after rows were dropped (a delta adds and updates
rows; it records no removal). Restoring needs about twice the table's memory (a file is
read whole, then copied into the table).
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any, Iterator, Mapping

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.params.rows import rowtable
from distbelief.runtime.params.rows.rowtable import RowTable
from distbelief.runtime.shard import checkpoint

log = logging.getLogger(__name__)

FULL_WRITE_BYTES = 256 << 20
# The optional per-row arrays (rowtable.py) by their names in checkpoints.
EXTRA = {"wideAccumulators": rowtable.WIDE_ACCUMULATORS, "stepped": rowtable.STEPPED,
         "occurrences": rowtable.OCCURRENCES}
FIELDS = ("keys", "values", "accumulators", "touched")  # every row's, in a row file's order
MAX_DELTAS = 8
FOLDER, SUFFIX = "rows", ".rows"
STATE_PREFIX = "sparse."
KEY_PART_BITS = 21
CHAIN = "sparseChain"


class RowCheckpoints:
    """What a shard's checkpoints hold of one RowTable, and the chain of row files it stands on."""

    def __init__(self, table: RowTable, folder: str, *, shard: int, layout: int,
                 full_write_bytes: int = FULL_WRITE_BYTES) -> None:
        self.table, self.main_folder, self.folder = table, folder, os.path.join(folder, FOLDER)
        self.shard, self.layout = shard, layout
        self.full_write_rows = max(1, full_write_bytes // ((table.dim + 5 + len(EXTRA)) * 4))
        self.chain: list[dict[str, Any]] = []  # base first, then its deltas

    def rows_dropped(self) -> None:
        """Rows were removed (expiry): the next file written is a new base."""
        self.chain = []

    # -- writing -----------------------------------------------------------------------------

    def state(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The arrays and metadata of the shard's next checkpoint; beyond full_write_rows, a
        base or a delta is written first (CheckpointError if it cannot be)."""
        t = self.table
        self._prune()
        if t.n <= self.full_write_rows:
            self.chain = []  # the next file, once the table outgrows this, is a base: it cleans then
            return self.whole()
        if self._needs_base():
            arrays = self._write("base", step, slice(0, t.n))
        else:
            arrays = self._write("delta", step, np.flatnonzero(t.dirty[: t.n]))
        return arrays, {"sparseRows": t.n, CHAIN: list(self.chain)}

    def whole(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Every row among the arrays, whatever the table's size; nothing written or marked saved."""
        arrays, touch_base = row_arrays(self.table, slice(0, self.table.n))
        return ({STATE_PREFIX + k: a for k, a in arrays.items()},
                {"sparseRows": self.table.n, "sparseTouchBase": touch_base})

    def _needs_base(self) -> bool:
        if not self.chain:
            return True
        deltas = self.chain[1:]
        return len(deltas) >= MAX_DELTAS or 2 * sum(d["rows"] for d in deltas) >= self.chain[0]["rows"]

    def _write(self, kind: str, step: int, rows: slice | np.ndarray) -> dict[str, np.ndarray]:
        """Write the rows as a base or delta file and add it to the chain. Non-finite rows are
        not written but returned, for the shard to see them and go back to its last checkpoint."""
        arrays, touch_base = row_arrays(self.table, rows)
        count = arrays["accumulators"].size
        if not np.isfinite(arrays["values"]).all():
            return {STATE_PREFIX + "values": arrays["values"]}
        if kind == "delta" and count == 0:
            return {}  # nothing pushed since the last file: the chain stands as it is
        name = f"{kind}-{step:012d}-{secrets.token_hex(4)}{SUFFIX}"
        sha = checkpoint.write(os.path.join(self.folder, name), checkpoint.Checkpoint(
            step=step, layout=self.layout, shard=self.shard, arrays=arrays, meta={"kind": kind, "touchBase": touch_base}))
        entry = {"file": name, "sha256": sha, "rows": count}
        self.chain = [entry] if kind == "base" else [*self.chain, entry]
        self.table.clean()
        log.info("event=rows_checkpoint shard=%d step=%d kind=%s rows=%d chain=%d", self.shard, step, kind, count,
                 len(self.chain))
        return {}

    def _prune(self) -> None:
        """Delete the row files that neither the chain nor any checkpoint in the folder names."""
        try:
            names = os.listdir(self.folder)
        except (FileNotFoundError, NotADirectoryError):
            return
        named = {entry["file"] for entry in self.chain}
        for path in checkpoint.list_checkpoints(self.main_folder):
            try:
                named |= {str(entry["file"]) for entry in checkpoint.read_meta(path).get(CHAIN) or []}
            except (errors.CorruptCheckpoint, KeyError, TypeError):
                continue  # a checkpoint that cannot be read cannot be restored either
        for name in names:
            if name.endswith(SUFFIX) and name not in named:
                try:
                    os.remove(os.path.join(self.folder, name))
                except OSError:
                    pass

    # -- reading -----------------------------------------------------------------------------

    def restore(self, ckpt: checkpoint.Checkpoint) -> int:
        """Load the table a checkpoint holds or names; how many rows. CorruptCheckpoint when a
        file of its chain is missing, damaged or not the one named."""
        chain = ckpt.meta.get(CHAIN)
        if chain is not None:
            checkpoint.remove_partial_writes(self.folder, SUFFIX)
        for position, (rows, extra) in enumerate(saved_parts(ckpt, self.main_folder, self.table.dim)):
            (self.table.load if position == 0 else self.table.put)(*rows, extra=extra)
        self.chain = [dict(entry) for entry in chain or []]
        return self.table.n  # no row is dirty: load() clears the flags and put() sets none


Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # keys, values [n, dim], accumulators, touched


def saved_parts(ckpt: checkpoint.Checkpoint, folder: str, dim: int) -> Iterator[tuple[Rows, dict[str, np.ndarray]]]:
    """The rows a shard's checkpoint in folder holds or names, with their optional arrays by
    the table's names: the whole table, or a base then its deltas (each updating and adding
    rows). CorruptCheckpoint when a file of the chain is missing, damaged or not the one named."""
    for arrays, touch_base in saved_files(ckpt, folder):
        yield rows_of([arrays[n] for n in FIELDS], dim, touch_base), extra_of(arrays)


def saved_files(ckpt: checkpoint.Checkpoint, folder: str) -> Iterator[tuple[dict[str, np.ndarray], float]]:
    """saved_parts' rows as they are stored (by their names in row files, keys as key_parts,
    values flat), each file's with the second its last-push times count from."""
    chain = ckpt.meta.get(CHAIN)
    if chain is None:
        arrays = {name: ckpt.arrays.get(STATE_PREFIX + name) for name in (*FIELDS, *EXTRA)}
        if arrays["values"] is None:  # written before the job had embeddings: the table starts empty
            yield {name: np.empty(0, np.float32) for name in FIELDS}, 0.0
        else:
            yield {n: a for n, a in arrays.items() if a is not None}, float(ckpt.meta.get("sparseTouchBase", 0.0))
        return
    for position, entry in enumerate(chain):
        part = _read(os.path.join(folder, FOLDER), entry, ckpt, "base" if position == 0 else "delta")
        yield part.arrays, float(part.meta.get("touchBase", 0.0))


def _read(folder: str, entry: Any, ckpt: checkpoint.Checkpoint, kind: str) -> checkpoint.Checkpoint:
    name = str(entry.get("file")) if isinstance(entry, dict) else ""
    path = os.path.join(folder, name)
    try:
        if os.path.basename(name) != name or not name.endswith(SUFFIX):
            raise errors.CorruptCheckpoint(f"{name!r} is not a row file's name")
        part = checkpoint.load(path, copy=False)  # views: a restore copies the rows into its table
        if part.sha256 != entry.get("sha256"):
            raise errors.CorruptCheckpoint(f"{path}: not the file the checkpoint names (SHA-256 differs)")
        if (part.layout, part.shard, part.meta.get("kind")) != (ckpt.layout, ckpt.shard, kind):
            raise errors.CorruptCheckpoint(f"{path}: not a {kind} of shard {ckpt.shard}'s rows in this layout")
    except errors.CorruptCheckpoint as exc:
        if os.path.isfile(path):
            os.replace(path, path + ".corrupt")
        raise errors.CorruptCheckpoint(f"the rows of the checkpoint of step {ckpt.step} cannot be restored: {exc}") \
            from exc
    return part


def row_arrays(table: RowTable, rows: slice | np.ndarray) -> tuple[dict[str, np.ndarray], float]:
    """Some rows of a table as float32 arrays, and the second their last-push times count from."""
    extra = {attribute: getattr(table, attribute)[rows] for attribute in EXTRA.values()
             if getattr(table, attribute) is not None}
    return arrays_of((table.keys[rows], table.values[rows], table.accumulators[rows], table.touched[rows]), extra)


def arrays_of(rows: Rows, extra: Mapping[str, np.ndarray],
              base: float | None = None) -> tuple[dict[str, np.ndarray], float]:
    """Rows as a checkpoint's float32 arrays, and the second their last-push times count from
    (base; None: the earliest of theirs)."""
    keys, values, accumulators, touched = rows
    if base is None:
        base = float(touched.min()) if touched.size else 0.0
    arrays = {"keys": key_parts(keys), "values": values, "accumulators": accumulators,
              "touched": (touched - base).astype(np.float32)}
    for name, attribute in EXTRA.items():
        if attribute in extra:
            arrays[name] = extra[attribute].astype(np.float32)
    return arrays, base


def extra_of(arrays: Mapping[str, np.ndarray], prefix: str = "") -> dict[str, np.ndarray]:
    """The optional per-row arrays a checkpoint holds, by the table's names for them."""
    return {attribute: arrays[prefix + name] for name, attribute in EXTRA.items() if prefix + name in arrays}


def rows_of(arrays: list[np.ndarray], dim: int, touch_base: float) -> Rows:
    """(keys, values, accumulators, touched) back from row_arrays' arrays."""
    keys, values, accumulators, touched = arrays
    return (keys_from_parts(keys), values.reshape(accumulators.size, dim), accumulators,
            touched.astype(np.float64) + touch_base)


def key_parts(keys: np.ndarray) -> np.ndarray:
    """Keys as [n, 3] float32 integers below 2**21: exact, and finite as checkpoints require."""
    mask = (1 << KEY_PART_BITS) - 1
    parts = np.empty((keys.size, 3), dtype=np.float32)
    for i in range(3):
        parts[:, i] = (keys >> (KEY_PART_BITS * i)) & mask
    return parts


def keys_from_parts(parts: np.ndarray) -> np.ndarray:
    p = parts.reshape(-1, 3)
    keys = p[:, 2].astype(np.int64)  # in place from here: one array of the keys' size, no wider temporary
    for column in (1, 0):
        keys <<= KEY_PART_BITS
        keys |= p[:, column].astype(np.int64)
    return keys
