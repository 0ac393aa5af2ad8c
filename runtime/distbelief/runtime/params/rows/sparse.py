"""Sparse embedding rows on the shards, as a plugin, with its two ops (the replica's side:
row_client.py).

    SPARSE_PULL   keys in -> their rows; a key without a row gets its initial value (the
                  row is not created: a pull never grows the table)
    SPARSE_PUSH   keys and their rows' gradients in -> row-wise Adagrad on them; a key's
                  row is created by its admitted push (spec.model.embeddings.admitAfter)

A key is a non-negative 63-bit integer, owned by shard rowkeys.owner_of(key) (a hash of the key,
modulo the shard count): the one function that partitions keys, on replicas and shards.
The keys travel in the payload frame (Keys: a count, then int64 values, at most
keys_per_request(dim) per shard and request, unique, each owned by the shard it is sent to); the
rows in the float32 array frame (count x dim). Sparse pushes do not advance the shard's
step: in a job with embeddings the dense push that follows them does.

Bounds. A push comes from a replica's minibatches: pushEvery steps of batchSize examples,
one id per field each. So a key occurs at most batchSize x pushEvery times in one push, and
a push carries at most that times the fields keys: occurrence counts declared beyond are
cut to it (what admission counts is never more than a batch could hold), and a push with
more keys is refused. The table has a row budget (spec.model.embeddings.maxRowsPerShard,
rowtable.py): a holder of the replicas' key can fill it, never grow it, and what the budget
refuses or evicts is counted (metrics, STATS and the job's condition RowBudgetReached).

Checkpoints: rowcheckpoint.py (the whole table up to FULL_WRITE_BYTES per shard, a base
and deltas of the rows pushed since beyond it). With admitAfter > 1 the admission
counters (4 MiB) are saved in every checkpoint too.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import struct
import time
from typing import Any, ClassVar, Mapping, Self

import numpy as np

from distbelief.runtime import errors, jobbase
from distbelief.runtime.params.rows import rowparts
from distbelief.runtime.params.rows.rowcheckpoint import FULL_WRITE_BYTES, STATE_PREFIX, RowCheckpoints
from distbelief.runtime.params.rows.rowtable import RowTable
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.core import Shard
from distbelief.runtime.shard.plugin import Answer, Handler
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Message, OpSpec
from distbelief.runtime.wire.rowkeys import owner_of

log = logging.getLogger(__name__)

MAX_KEYS = 1 << 18          # keys in one request to one shard
MAX_ROW_VALUES = 1 << 24    # float32 values of rows in one request (64 MiB): fewer keys when dim is large
KEY_BITS = 63
EXPIRY_CHECKS = 8           # look for expired rows this many times per expireAfterSeconds
PROCESS_BYTES = 256 << 20   # a shard process before its data and parameters (interpreter, numpy, ZeroMQ, buffers)
MIN_BUDGET = 1024           # the smallest row budget (spec.model.embeddings.maxRowsPerShard's minimum)
KEY_DTYPE = np.dtype("<i8")
OCCURRENCE_DTYPE = np.dtype("<u4")


def row_budget(memory_limit: str | None, row_bytes: float, other_bytes: int) -> int | None:
    """The rows a shard may hold under its memory limit (spec.parameterServers.resources.limits.memory):
    half of what the process (PROCESS_BYTES) and other_bytes (its data set, its dense slice)
    leave, since restoring a checkpoint holds the table twice for a moment; at least
    MIN_BUDGET. None without a limit."""
    if not memory_limit:
        return None
    left = int(jobbase.quantity(memory_limit)) - PROCESS_BYTES - other_bytes
    return max(MIN_BUDGET, int(left / 2 / row_bytes))


def keys_per_request(dim: int) -> int:
    """The most keys one request to one shard may carry, for rows of dim values."""
    return max(1, min(MAX_KEYS, MAX_ROW_VALUES // dim))



@dataclasses.dataclass(frozen=True)
class Keys(protocol.Payload):
    """Unique non-negative int64 keys, at most MAX_KEYS, after a uint32 count."""

    keys: np.ndarray
    COUNT: ClassVar[struct.Struct] = struct.Struct("<I")
    BYTES_PER_KEY: ClassVar[int] = KEY_DTYPE.itemsize

    def pack(self) -> bytes:
        return self.COUNT.pack(self.keys.size) + np.ascontiguousarray(self.keys, dtype=KEY_DTYPE).tobytes()

    @classmethod
    def unpack(cls, frame: bytes | memoryview) -> Self:
        payload = cls(cls._keys_of(frame))
        payload.check()
        return payload

    @classmethod
    def _keys_of(cls, frame: bytes | memoryview) -> np.ndarray:
        if len(frame) < cls.COUNT.size:
            raise errors.ProtocolError(f"a key list is {len(frame)} bytes, shorter than its count")
        (count,) = cls.COUNT.unpack_from(frame)
        if count > MAX_KEYS:
            raise errors.ProtocolError(f"{count} keys in one request, at most {MAX_KEYS}")
        if len(frame) != cls.COUNT.size + count * cls.BYTES_PER_KEY:
            raise errors.ProtocolError(f"a key list of {len(frame)} bytes does not hold the {count} keys it declares")
        return np.frombuffer(frame, dtype=KEY_DTYPE, count=count, offset=cls.COUNT.size).astype(np.int64)

    def check(self) -> None:
        if self.keys.size and int(self.keys.min()) < 0:
            raise errors.ProtocolError("keys must be non-negative (63-bit)")
        if np.unique(self.keys).size != self.keys.size:
            raise errors.ProtocolError("keys must be unique within a request")


@dataclasses.dataclass(frozen=True)
class KeyCounts(Keys):
    """Keys, then how many times each occurred in the pushed examples (uint32 each, >= 1):
    what admission counts."""

    occurrences: np.ndarray
    BYTES_PER_KEY: ClassVar[int] = KEY_DTYPE.itemsize + OCCURRENCE_DTYPE.itemsize

    def pack(self) -> bytes:
        counts = np.minimum(self.occurrences, np.iinfo(OCCURRENCE_DTYPE).max)
        return super().pack() + np.ascontiguousarray(counts, dtype=OCCURRENCE_DTYPE).tobytes()

    @classmethod
    def unpack(cls, frame: bytes | memoryview) -> Self:
        keys = cls._keys_of(frame)
        offset = cls.COUNT.size + keys.size * KEY_DTYPE.itemsize
        occurrences = np.frombuffer(frame, dtype=OCCURRENCE_DTYPE, count=keys.size, offset=offset).astype(np.int64)
        payload = cls(keys, occurrences)
        payload.check()
        return payload

    def check(self) -> None:
        super().check()
        if self.occurrences.size != self.keys.size:
            raise errors.ProtocolError(f"{self.occurrences.size} occurrence counts for {self.keys.size} keys")
        if self.occurrences.size and int(self.occurrences.min()) < 1:
            raise errors.ProtocolError("a pushed key occurs at least once")


SPARSE_PULL = protocol.define(OpSpec(20, "SPARSE_PULL", request=Keys, reply_array=True))
SPARSE_PUSH = protocol.define(OpSpec(21, "SPARSE_PUSH", request=KeyCounts, request_array=True, command=True))


class SparseRows:
    """A shard's part of the embedding table: the rows whose keys it owns."""

    def __init__(self, shard: Shard, *, dim: int, learning_rate: float, seed: int, admit_after: int = 1,
                 expire_after: float | None = None, max_gradient_norm: float = float("inf"),
                 full_write_bytes: int = FULL_WRITE_BYTES, wide: int = 0, l2: float = 0.0,
                 wide_l2: float = 0.0, embed_after: int = 1, max_rows: int | None = None,
                 push_examples: int | None = None, fields: int | None = None, optimizer: str = "adagrad") -> None:
        """dim: values per row, the last `wide` of them the wide part (rowtable.py);
        push_examples: the most examples behind one push (batchSize x pushEvery), and fields:
        the ids per example, which bound what a push may declare (None: unbounded)."""
        self.shard = shard
        self.table = RowTable(dim, learning_rate=learning_rate, seed=seed, admit_after=admit_after,
                              expire_after=expire_after, wide=wide, l2=l2, wide_l2=wide_l2,
                              embed_after=embed_after, max_rows=max_rows, optimizer=optimizer)
        self.push_examples = push_examples
        self.push_keys = None if push_examples is None or fields is None else push_examples * fields
        shard.metrics.row_budget.set(max_rows or 0)
        shard.watch_updates(RowFigures(self.table))
        self.saved = RowCheckpoints(self.table, shard.settings.checkpoint_dir, shard=shard.index,
                                    layout=shard.layout.hash, full_write_bytes=full_write_bytes)
        self.max_gradient_norm = np.float32(min(max_gradient_norm, np.finfo(np.float32).max))
        self._next_expiry = time.time() + self._expiry_interval()
        self._indexes: dict[str, rowparts.PartIndex] = {}  # the transfers under way to copies catching up
        self._receiving: rowparts.Receiving | None = None

    @property
    def dim(self) -> int:
        return self.table.dim

    def handlers(self) -> Mapping[OpSpec, Handler]:
        return {SPARSE_PULL: self._pull, SPARSE_PUSH: self._push}

    def repeat_handlers(self) -> Mapping[OpSpec, Handler]:
        return {}

    def array_values(self) -> int:
        # The keys' frame (12 bytes a key with its count) is capped by the same frame size: 3 values a key.
        return keys_per_request(self.dim) * max(self.dim, 3)

    # -- ops -------------------------------------------------------------------------------

    def _pull(self, message: Message) -> Answer:
        keys = self._owned(message.meta.keys)
        return Answer(array=self.table.rows(keys).reshape(-1))

    def _push(self, message: Message) -> Answer:
        keys = self._owned(message.meta.keys)
        grads = message.array
        if grads is None or grads.size != keys.size * self.dim:
            raise errors.ProtocolError(f"a sparse push of {keys.size} keys must carry {keys.size * self.dim} "
                                       f"float32 values, got {message.header.count}")
        if self.push_keys is not None and keys.size > self.push_keys:
            raise errors.ProtocolError(f"a sparse push of {keys.size} keys, more than a push's examples can hold "
                                       f"({self.push_keys}: batchSize x pushEvery x fields)")
        occurrences = message.meta.occurrences
        if self.push_examples is not None:  # an id occurs at most once an example
            occurrences = np.minimum(occurrences, self.push_examples)
        now = time.time()
        grads = grads.reshape(keys.size, self.dim)
        if self._receiving is not None:  # a copy catching up: only the parts it holds
            keep = self._receiving.keep(keys)
            keys, grads, occurrences = keys[keep], grads[keep], occurrences[keep]
        t = self.table
        refused, evicted = t.refused, t.evicted
        t.update(keys, self._bounded(grads), now, occurrences, step=self.shard.step)
        if t.evicted > evicted:
            self.saved.rows_dropped()
            self.shard.metrics.rows_evicted.inc(t.evicted - evicted)
        if t.refused > refused:
            self.shard.metrics.rows_refused.inc(t.refused - refused)
            if not refused:
                log.warning("event=row_budget_reached shard=%d rows=%d budget=%d consequence=new_rows_refused",
                            self.shard.index, t.n, t.max_rows)
        if now >= self._next_expiry:
            self._expire(now)
        self.shard.metrics.rows.set(t.n)
        return Answer()

    def _owned(self, keys: np.ndarray) -> np.ndarray:
        if keys.size > keys_per_request(self.dim):
            raise errors.ProtocolError(f"{keys.size} keys in one request, at most {keys_per_request(self.dim)} "
                                       f"for rows of {self.dim} values")
        if keys.size and (owner_of(keys, self.shard.layout.shards) != self.shard.index).any():
            raise errors.ProtocolError(f"keys sent to shard {self.shard.index} that another shard owns")
        return keys

    def _bounded(self, grads: np.ndarray) -> np.ndarray:
        """Each row's gradient scaled down to max_gradient_norm; Refused if any is not finite.
        Rows are independent parameters, so each gets its own bound."""
        with np.errstate(over="ignore", invalid="ignore"):
            norms = np.sqrt(np.einsum("ij,ij->i", grads, grads, dtype=np.float64))
        if not np.isfinite(grads).all():
            raise errors.Refused("row gradients have non-finite values; update refused")
        over = norms > self.max_gradient_norm
        if not over.any():
            return grads
        self.shard.metrics.clipped.inc()
        scale = np.where(over, self.max_gradient_norm / np.maximum(norms, 1e-30), 1.0).astype(np.float32)
        return grads * scale[:, None]

    def _expire(self, now: float) -> None:
        dropped = self.table.expire(now)
        self._next_expiry = now + self._expiry_interval()
        if dropped:
            self.saved.rows_dropped()
            log.info("event=rows_expired shard=%d dropped=%d rows=%d", self.shard.index, dropped, self.table.n)

    def _expiry_interval(self) -> float:
        expire_after = self.table.expire_after
        return float("inf") if expire_after is None else max(1.0, expire_after / EXPIRY_CHECKS)

    # -- a copy catching up (plugin.Transferable, rowparts.py) ---------------------------------

    def transfer_plan(self) -> dict[str, Any]:
        bits = rowparts.part_bits(self.table.n, self.dim)
        plan_id = secrets.token_hex(4)
        while len(self._indexes) >= 2:  # one transfer at a time is the rule; an old one's goes
            self._indexes.pop(next(iter(self._indexes)))
        self._indexes[plan_id] = rowparts.PartIndex(self.table, bits)
        return {"dim": self.dim, "bits": bits, "parts": 1 << bits, "id": plan_id,
                "counters": self.table.counts is not None}

    def read_part(self, plan: dict[str, Any], part: int) -> dict[str, np.ndarray]:
        index = self._indexes.get(plan["id"])
        if index is None:
            index = self._indexes[plan["id"]] = rowparts.PartIndex(self.table, int(plan["bits"]))
        arrays = rowparts.read(self.table, index, part)
        if part == int(plan["parts"]) - 1:
            self._indexes.pop(plan["id"], None)
        return arrays

    def begin_receiving(self, plan: dict[str, Any]) -> None:
        bits = plan.get("bits")
        if plan.get("dim") != self.dim or plan.get("counters") != (self.table.counts is not None) or \
                not isinstance(bits, int) or not 0 <= bits <= rowparts.COUNTER_BITS:
            raise errors.ConfigError(f"shard {self.shard.index}: a transfer of rows {plan} to rows of dim {self.dim}")
        t = self.table
        t.load(np.empty(0, np.int64), np.empty((0, self.dim), np.float32), np.empty(0, np.float32),
               np.empty(0, np.uint32))
        if t.counts is not None:
            t.counts[...] = 0
        self._receiving = rowparts.Receiving(bits)

    def write_part(self, part: int, arrays: dict[str, np.ndarray]) -> None:
        receiving = self._receiving
        if receiving is None or not 0 <= part < receiving.received.size or receiving.received[part]:
            raise errors.ProtocolError(f"part {part} of rows, not expected now")
        rowparts.write(self.table, part, receiving.bits, arrays)
        receiving.received[part] = True

    def end_receiving(self) -> None:
        if self._receiving is not None and not self._receiving.received.all():
            log.warning("event=rows_transfer_incomplete shard=%d missing=%d", self.shard.index,
                        int((~self._receiving.received).sum()))
        self._receiving = None
        self.saved.rows_dropped()  # the next checkpoint writes a base of this table

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint_state(self, *, transfer: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        # A copy catching up gets every row: the row files a checkpoint names are on this machine.
        arrays, meta = self.saved.whole() if transfer else self.saved.state(self.shard.step)
        t = self.table
        if t.counts is not None:  # capped at admitAfter (<= 1e6): exact in float32
            arrays[STATE_PREFIX + "admission"] = np.minimum(t.counts, t.admit_after).astype(np.float32)
        return arrays, {**meta, "sparseDim": self.dim, "sparseWide": self.table.wide}

    def restore(self, ckpt: checkpoint.Checkpoint) -> None:
        saved = (int(ckpt.meta.get("sparseDim", self.dim)), int(ckpt.meta.get("sparseWide", 0)))
        if saved != (self.dim, self.table.wide):
            raise errors.ConfigError(
                f"shard {self.shard.index}: the checkpoints in {self.shard.settings.checkpoint_dir} hold embedding "
                f"rows of {_row_shape(*saved)}, and this job's rows are {_row_shape(self.dim, self.table.wide)} "
                "(spec.model.embeddings.dim and .wide)")
        self.table.step = ckpt.step  # rows saved without the step of their last push count from here
        n = self.saved.restore(ckpt)
        counts = ckpt.arrays.get(STATE_PREFIX + "admission")
        if self.table.counts is not None and counts is not None and counts.size == self.table.counts.size:
            self.table.counts[...] = counts
        log.info("event=rows_restored shard=%d rows=%d", self.shard.index, n)


def _row_shape(values: int, wide: int) -> str:
    return f"{values - wide} embedding values" + (f" and {wide} wide" if wide else " (no wide part)")


class RowFigures:
    """The table's figures in the shard's STATS (plugin.UpdateHook; it admits every replica):
    what the chief reads of every shard to tell the job's condition RowBudgetReached."""

    def __init__(self, table: RowTable) -> None:
        self.table = table

    def admit(self, peer: tuple) -> bool:
        return True

    def applied(self, peer: tuple, header: protocol.Header, *, examples: int, loss: float) -> None:
        pass

    def figures(self) -> dict[str, Any]:
        t = self.table
        return {"rows": t.n, "rowBudget": t.max_rows or 0, "rowsRefused": t.refused, "rowsEvicted": t.evicted}
