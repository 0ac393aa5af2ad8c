"""The wire protocol between replicas, the chief and the parameter shards.

A message is one fixed-size header frame, optionally followed by one payload frame:

    header   48 bytes, little-endian (see HEADER)
    payload  raw float32 values (pull replies, pushes) or UTF-8 text (errors, stats, done)

The header carries the protocol version, the op, a reply status, the shard index, a
request sequence number, the sender's worker id, the model layout hash, a step, the
number of float32 values in the payload, and for pushes the examples and mean loss the
gradient stands for. Everything a peer sends is checked here before a shard acts on it;
nothing is ever unpickled.

Sandblaster L-BFGS adds ops whose small fixed payloads are the structs below
(VectorCommand, VectorResult, WorkUnit, UnitResult). Their header fields:

    BEGIN_EVAL   step = evaluation id, count = work units in it
    PULL_POINT   reply: step = the shard's current evaluation id; payload = the trial point
    ACCUMULATE   step = evaluation id, examples = unit index; payload = the unit's gradient;
                 reply: count = 1 if added, 0 if dropped (a duplicate or a stale evaluation)
    VECTOR       payload = VectorCommand; reply payload = VectorResult
    COMMIT       step = L-BFGS iteration; payload = the coordinator's state (JSON text)
    ROLLBACK     step = the committed iteration to go back to
    STATE        reply payload = JSON text (iteration, incarnation, checkpoints held, ...)
    WORK         replica -> coordinator; payload = UnitResult of the last unit, if any;
                 reply: OK + WorkUnit, WAIT, or DONE
"""

from __future__ import annotations

import dataclasses
import enum
import struct

import numpy as np

from distbelief.runtime import errors

MAGIC = b"DB"
VERSION = 1
DTYPE = np.dtype("<f4")
HEADER = struct.Struct("<2sBBBxHIIQQQIf")
# Text payloads (errors, stats, done reasons) are small; refuse anything bigger.
MAX_TEXT_BYTES = 64 * 1024


class Op(enum.IntEnum):
    """The op table. New ops (the coordinator's vector ops) are added here."""

    HELLO = 1   # -> shard size, step; warm-start admission from shard 0
    PULL = 2    # -> the shard's parameters
    PUSH = 3    # gradient in; -> new step
    STATS = 4   # -> JSON text with the shard's figures
    DONE = 5    # the chief ends the job; payload: the reason
    BEGIN_EVAL = 6   # Sandblaster: start accumulating a new evaluation of the trial point
    PULL_POINT = 7   # -> the trial point the current evaluation is at
    ACCUMULATE = 8   # one work unit's gradient in, added once per unit
    VECTOR = 9       # one vector op on the shard's slice; -> a scalar
    COMMIT = 10      # end of an L-BFGS iteration: checkpoint it with the coordinator's state
    ROLLBACK = 11    # reload a committed iteration from the shard's checkpoint
    STATE = 12       # -> the shard's Sandblaster state as JSON
    WORK = 13        # replica <-> coordinator: a result in, the next work unit out
    PUSH_PULL = 14   # gradient in; -> the parameters with it applied (a push and the next pull
                     # in one round trip, when a replica fetches right after it pushes)


class Status(enum.IntEnum):
    OK = 0
    DONE = 1    # the job has finished: the peer should stop
    WAIT = 2    # warm-start: another replica trains alone for now
    ERROR = 3   # payload: UTF-8 message


@dataclasses.dataclass(frozen=True)
class Header:
    op: int
    shard: int
    layout: int
    status: int = Status.OK
    seq: int = 0
    worker: int = 0
    step: int = 0
    count: int = 0
    examples: int = 0
    loss: float = 0.0

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.op, self.status, self.shard, self.seq,
                           self.worker, self.layout, self.step, self.count, self.examples,
                           self.loss)

    def reply(self, *, status: int = Status.OK, step: int = 0, count: int = 0) -> "Header":
        """The header of the answer to this request: same op, shard, seq and layout."""
        return dataclasses.replace(self, status=status, step=step, count=count,
                                   examples=0, loss=0.0)


def unpack_header(frame: bytes | memoryview) -> Header:
    """Parse and check a header frame; ProtocolError says what is wrong with it."""
    if len(frame) != HEADER.size:
        raise errors.ProtocolError(f"header is {len(frame)} bytes, expected {HEADER.size}")
    (magic, version, op, status, shard, seq, worker, layout, step, count, examples,
     loss) = HEADER.unpack(frame)
    if magic != MAGIC:
        raise errors.ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise errors.ProtocolError(f"protocol version {version}, this peer speaks {VERSION}")
    if op not in Op._value2member_map_:
        raise errors.ProtocolError(f"unknown op {op}")
    if status not in Status._value2member_map_:
        raise errors.ProtocolError(f"unknown status {status}")
    if not np.isfinite(loss):
        raise errors.ProtocolError("loss is not a finite number")
    return Header(op=op, status=status, shard=shard, seq=seq, worker=worker, layout=layout,
                  step=step, count=count, examples=examples, loss=loss)


class VectorCode(enum.IntEnum):
    """What a VECTOR command does with the shard's named vectors (out, a, b are slots)."""

    ZERO = 1    # out = 0
    COPY = 2    # out = a
    SCALE = 3   # out *= scalar
    AXPY = 4    # out += scalar * a
    DOT = 5     # -> a . b (this shard's part of it)


@dataclasses.dataclass(frozen=True)
class VectorCommand:
    code: int
    out: int = 0
    a: int = 0
    b: int = 0
    scalar: float = 0.0

    STRUCT = struct.Struct("<BBBBxxxxd")

    def pack(self) -> bytes:
        return self.STRUCT.pack(self.code, self.out, self.a, self.b, self.scalar)

    @classmethod
    def unpack(cls, frame: memoryview | bytes, slots: int) -> "VectorCommand":
        """Parse and check a command against the number of vector slots the shard has."""
        code, out, a, b, scalar = _unpack(cls.STRUCT, frame, "vector command")
        if code not in VectorCode._value2member_map_:
            raise errors.ProtocolError(f"unknown vector op {code}")
        for name, slot in (("out", out), ("a", a), ("b", b)):
            if slot >= slots:
                raise errors.ProtocolError(f"vector slot {name}={slot} out of range (the shard has {slots})")
        if not np.isfinite(scalar):
            raise errors.ProtocolError("vector op scalar is not a finite number")
        return cls(code=code, out=out, a=a, b=b, scalar=scalar)


@dataclasses.dataclass(frozen=True)
class VectorResult:
    value: float      # the dot product (0 for other ops)
    units: int        # work units accumulated in the shard's current evaluation
    incarnation: int  # changes when the shard process restarts

    STRUCT = struct.Struct("<dQQ")

    def pack(self) -> bytes:
        return self.STRUCT.pack(self.value, self.units, self.incarnation)

    @classmethod
    def unpack(cls, frame: memoryview | bytes) -> "VectorResult":
        value, units, incarnation = _unpack(cls.STRUCT, frame, "vector result")
        if not np.isfinite(value):
            raise errors.ProtocolError("vector result is not a finite number")
        return cls(value=value, units=units, incarnation=incarnation)


@dataclasses.dataclass(frozen=True)
class WorkUnit:
    """Examples [start, stop) of the training set, to evaluate at evaluation `evaluation`'s
    point; `total` examples make up the whole batch (the gradient is weighted by share)."""

    evaluation: int
    unit: int
    start: int
    stop: int
    total: int

    STRUCT = struct.Struct("<QIIII")

    def pack(self) -> bytes:
        return self.STRUCT.pack(self.evaluation, self.unit, self.start, self.stop, self.total)

    @classmethod
    def unpack(cls, frame: memoryview | bytes) -> "WorkUnit":
        evaluation, unit, start, stop, total = _unpack(cls.STRUCT, frame, "work unit")
        if not 0 <= start < stop <= total:
            raise errors.ProtocolError(f"work unit [{start}, {stop}) is not within a batch of {total}")
        return cls(evaluation=evaluation, unit=unit, start=start, stop=stop, total=total)


@dataclasses.dataclass(frozen=True)
class UnitResult:
    """A replica's answer for one work unit: its share of the objective, or `lost` when a
    shard no longer held the unit's evaluation (it restarted)."""

    evaluation: int
    unit: int
    examples: int
    loss: float
    lost: bool = False

    STRUCT = struct.Struct("<QIIdB7x")

    def pack(self) -> bytes:
        return self.STRUCT.pack(self.evaluation, self.unit, self.examples, self.loss, self.lost)

    @classmethod
    def unpack(cls, frame: memoryview | bytes) -> "UnitResult":
        evaluation, unit, examples, loss, lost = _unpack(cls.STRUCT, frame, "unit result")
        if not np.isfinite(loss):
            raise errors.ProtocolError("unit result loss is not a finite number")
        return cls(evaluation=evaluation, unit=unit, examples=examples, loss=loss, lost=bool(lost))


def _unpack(layout: struct.Struct, frame: memoryview | bytes, what: str) -> tuple:
    if len(frame) != layout.size:
        raise errors.ProtocolError(f"{what} is {len(frame)} bytes, expected {layout.size}")
    return layout.unpack(frame)


def float_view(frame: memoryview | bytes, count: int) -> np.ndarray:
    """A read-only float32 view over a payload frame, checked against its declared count."""
    nbytes = len(frame)
    if nbytes != count * DTYPE.itemsize:
        raise errors.ProtocolError(
            f"payload is {nbytes} bytes but the header declares {count} float32 values"
        )
    return np.frombuffer(frame, dtype=DTYPE, count=count)


def small_payload(frame: memoryview | bytes) -> bytes:
    """A text or struct payload, refused above MAX_TEXT_BYTES."""
    if len(frame) > MAX_TEXT_BYTES:
        raise errors.ProtocolError(f"text payload of {len(frame)} bytes exceeds {MAX_TEXT_BYTES}")
    return bytes(frame)


def decode_text(frame: memoryview | bytes) -> str:
    return small_payload(frame).decode("utf-8", errors="replace")


def max_message_bytes(slice_size: int) -> int:
    """The largest message a shard of this size accepts (ZMQ_MAXMSGSIZE)."""
    return HEADER.size + max(slice_size * DTYPE.itemsize, MAX_TEXT_BYTES)
