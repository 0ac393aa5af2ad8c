"""The wire protocol between replicas, the chief, the coordinator and the parameter shards.

A message is a fixed header frame, then the op's own frames:

    header   40 bytes, little-endian (HEADER): magic, version, op, status, error code,
             shard, seq, worker, layout hash, step, count
    meta     the op's payload struct (a fixed-size Payload, or a bounded JSON object)
    array    raw values, `count` of them (parameters, gradients): float32, or bfloat16
             (uint16) for the ops whose OpSpec says so, so a message's format is its op's

Which frames an op carries, in its request and in its reply, is its OpSpec; the module
that owns an op defines it (`define`), so an algorithm adds ops without touching this
file. Header fields mean one thing for every op: `step` is the shard's step in a reply
and the step a request was computed from; `count` is the length of the array frame.
A reply with status ERROR carries an ErrorCode and one text frame; DONE and WAIT carry
nothing. Everything a peer sends is checked here before a shard acts on it; nothing is
ever unpickled.

A peer of protocol version 1 gets one error reply in its own header format, naming both
versions, rather than silence.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
from typing import Any, ClassVar, Self

import numpy as np

from distbelief.runtime import errors

MAGIC = b"DB"
VERSION = 2
DTYPE = np.dtype("<f4")
BFLOAT16 = np.dtype("<u2")  # a bfloat16 is a float32's high 16 bits (bfloat16.py)
WIRE_NAMES = {DTYPE: "float32", BFLOAT16: "bfloat16"}  # spec.parameterServers.wireFormat's values
HEADER = struct.Struct("<2sBBBBHIIQQQ")
# Text and struct payloads (errors, stats, done reasons, coordinator state) are small.
MAX_TEXT_BYTES = 64 * 1024
MAX_EXAMPLES = 1 << 24    # examples one update or work unit may stand for
MAX_LOSS = 1e30           # a reported loss beyond this is no honest replica's
# Version 1's header, only to tell its peers in their own format that they are too old.
V1_HEADER = struct.Struct("<2sBBBxHIIQQQIf")
V1_ERROR = 3


class Status(enum.IntEnum):
    OK = 0
    DONE = 1    # the job has finished: the peer should stop
    WAIT = 2    # warm-start: another replica trains alone for now; no work unit yet
    ERROR = 3   # header.error says which; one text frame says why
    STALE = 4   # not applied: computed from parameters more than maxStaleness steps old;
                # the reply carries what the op's reply carries (the fresh slice, for PUSH_PULL)
    FULL = 5    # not taken: the shard has no room for it now (a partitioned replica's HOLD
                # while the shard holds as many steps in flight as it may); back off, send again


class ErrorCode(enum.IntEnum):
    NONE = 0
    MALFORMED = 1    # a message that breaks the protocol (frames, sizes, values)
    WRONG_SHARD = 2  # addressed to another shard
    LAYOUT = 3       # the peer partitions another model, or over another shard count
    NOT_SERVED = 4   # an op this shard's algorithm does not serve
    REFUSED = 5      # well formed, but not applied (a non-finite gradient)
    FORBIDDEN = 6    # a privileged op from a peer without the chief's key
    STATE = 7        # the shard's state cannot take it (a rollback to an iteration it lacks)
    NOT_PRIMARY = 8  # a shard copy that serves no clients now: ask the shard's next copy


# -- payloads ------------------------------------------------------------------------------


class Payload:
    """A fixed-size struct payload; subclasses are frozen dataclasses with FORMAT and check()."""

    FORMAT: ClassVar[struct.Struct]

    def pack(self) -> bytes:
        return self.FORMAT.pack(*dataclasses.astuple(self))  # type: ignore[call-overload]

    @classmethod
    def unpack(cls, frame: bytes | memoryview) -> Self:
        if len(frame) != cls.FORMAT.size:
            raise errors.ProtocolError(f"{cls.__name__} is {len(frame)} bytes, expected {cls.FORMAT.size}")
        payload = cls(*cls.FORMAT.unpack(frame))
        payload.check()
        return payload

    def check(self) -> None:
        """Raise ProtocolError for values no honest peer sends."""


@dataclasses.dataclass(frozen=True)
class JsonObject(Payload):
    """A JSON object of at most MAX_TEXT_BYTES (stats, a done reason, coordinator state)."""

    value: dict[str, Any]

    def pack(self) -> bytes:
        return json.dumps(self.value).encode()

    @classmethod
    def unpack(cls, frame: bytes | memoryview) -> Self:
        try:
            value = json.loads(small_payload(frame).decode("utf-8"))
        except ValueError as exc:
            raise errors.ProtocolError(f"unreadable JSON payload: {exc}") from exc
        if not isinstance(value, dict):
            raise errors.ProtocolError("a JSON payload must be an object")
        return cls(value)


@dataclasses.dataclass(frozen=True)
class ShardInfo(Payload):
    """HELLO's answer: the size of the shard's dense slice."""

    size: int
    FORMAT = struct.Struct("<Q")


# -- ops -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """What an op's request and reply carry, and how a shard must treat it.

    command: it changes the shard's state, so a resend (same peer, worker, seq) gets the
    first reply and is not applied twice. privileged: only the chief's key may send it.
    dtype: the array frames' values, float32 (DTYPE) or bfloat16 carried as uint16."""

    code: int
    name: str
    request: type[Payload] | None = None
    reply: type[Payload] | None = None
    request_array: bool = False
    reply_array: bool = False
    optional_request: bool = False
    command: bool = False
    privileged: bool = False
    dtype: np.dtype = DTYPE

    def __int__(self) -> int:
        return self.code


OPS: dict[int, OpSpec] = {}


def define(spec: OpSpec) -> OpSpec:
    """Register an op; its code must be new."""
    if spec.code in OPS and OPS[spec.code] != spec:
        raise ValueError(f"op code {spec.code} is taken by {OPS[spec.code].name}")
    if spec.optional_request and spec.request_array:
        raise ValueError(f"op {spec.name}: an optional payload cannot precede an array")
    OPS[spec.code] = spec
    return spec


HELLO = define(OpSpec(1, "HELLO", reply=ShardInfo))           # join: layout check, warm-start admission
STATS = define(OpSpec(4, "STATS", reply=JsonObject))          # the shard's figures
DONE = define(OpSpec(5, "DONE", request=JsonObject, command=True, privileged=True))  # the chief ends the job


def spec_of(code: int) -> OpSpec:
    try:
        return OPS[code]
    except KeyError:
        raise errors.ProtocolError(f"unknown op {code}") from None


# -- the header ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Header:
    op: int
    shard: int
    layout: int
    status: int = Status.OK
    error: int = ErrorCode.NONE
    seq: int = 0
    worker: int = 0
    step: int = 0
    count: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.op, self.status, self.error, self.shard, self.seq,
                           self.worker, self.layout, self.step, self.count)

    def reply(self, *, status: int = Status.OK, step: int = 0, count: int = 0,
              error: int = ErrorCode.NONE) -> "Header":
        """The header of the answer to this request: same op, shard, seq, worker and layout."""
        return dataclasses.replace(self, status=status, step=step, count=count, error=error)


def unpack_header(frame: bytes | memoryview) -> Header:
    """Parse and check a header frame; ProtocolError says what is wrong with it."""
    if len(frame) >= 3 and bytes(frame[:2]) == MAGIC and frame[2] != VERSION:
        raise errors.ProtocolError(f"the peer speaks protocol version {frame[2]}, this one speaks {VERSION}")
    if len(frame) != HEADER.size:
        raise errors.ProtocolError(f"header is {len(frame)} bytes, expected {HEADER.size}")
    (magic, _, op, status, error, shard, seq, worker, layout, step, count) = HEADER.unpack(frame)
    if magic != MAGIC:
        raise errors.ProtocolError(f"bad magic {magic!r}")
    spec_of(op)
    if status not in Status._value2member_map_:
        raise errors.ProtocolError(f"unknown status {status}")
    if error not in ErrorCode._value2member_map_:
        raise errors.ProtocolError(f"unknown error code {error}")
    return Header(op=op, status=status, error=error, shard=shard, seq=seq, worker=worker, layout=layout,
                  step=step, count=count)


def old_version_refusal(frame: bytes | memoryview) -> bytes | None:
    """For a version-1 request, the error header a version-1 peer can read; else None."""
    if len(frame) != V1_HEADER.size or bytes(frame[:2]) != MAGIC or frame[2] != 1:
        return None
    (_, _, op, _, shard, seq, worker, layout, *_) = V1_HEADER.unpack(frame)
    return V1_HEADER.pack(MAGIC, 1, op, V1_ERROR, shard, seq, worker, layout, 0, 0, 0, 0.0)


def version_refusal_text() -> bytes:
    return f"this shard speaks protocol version {VERSION}, the peer speaks 1: upgrade the peer's image".encode()


# -- whole messages --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Message:
    """A parsed request (or reply): its header, its op's payload, its array (of the op's dtype)."""

    header: Header
    spec: OpSpec
    meta: Any = None
    array: np.ndarray | None = None


def parse_request(frames: list[memoryview], header: Header | None = None) -> Message:
    """Check a request's frames against its op's spec; ProtocolError says what is wrong.
    header: frames[0] already parsed (the shard reads it first to address its errors)."""
    header = header or unpack_header(frames[0])
    if header.status != Status.OK or header.error != ErrorCode.NONE:  # statuses are the shard's to give
        raise errors.ProtocolError("a request must have status OK and no error code")
    spec = spec_of(header.op)
    body = frames[1:]
    meta_frames = 1 if spec.request is not None else 0
    expected = meta_frames + (1 if spec.request_array else 0)
    if spec.optional_request and len(body) == 0:
        return Message(header=header, spec=spec)
    if len(body) != expected:
        raise errors.ProtocolError(f"{spec.name} carries {expected} frames after its header, got {len(body)}")
    meta = spec.request.unpack(body[0]) if spec.request is not None else None
    array = array_view(body[-1], header.count, spec.dtype) if spec.request_array else None
    if not spec.request_array and header.count:
        raise errors.ProtocolError(f"{spec.name} carries no array, but the header declares {header.count} values")
    return Message(header=header, spec=spec, meta=meta, array=array)


def reply_frames(request: Header, *, step: int, status: int = Status.OK, meta: Payload | None = None,
                 array: np.ndarray | None = None) -> list:
    frames: list = [request.reply(status=status, step=step, count=0 if array is None else array.size).pack()]
    if meta is not None:
        frames.append(meta.pack())
    if array is not None:
        frames.append(memoryview(array))
    return frames


def error_frames(request: Header, code: ErrorCode, text: str, *, step: int = 0) -> list:
    return [request.reply(status=Status.ERROR, error=code, step=step).pack(), text.encode()[:MAX_TEXT_BYTES]]


_CODES: tuple[tuple[type, ErrorCode], ...] = (
    (errors.LayoutMismatch, ErrorCode.LAYOUT), (errors.WrongShard, ErrorCode.WRONG_SHARD),
    (errors.NotServed, ErrorCode.NOT_SERVED), (errors.Refused, ErrorCode.REFUSED),
    (errors.Forbidden, ErrorCode.FORBIDDEN),
    (errors.StateConflict, ErrorCode.STATE), (errors.NotPrimary, ErrorCode.NOT_PRIMARY))


def error_code(exc: errors.ProtocolError) -> ErrorCode:
    """The code an error reply carries for exc."""
    return next((code for kind, code in _CODES if isinstance(exc, kind)), ErrorCode.MALFORMED)


def float_view(frame: memoryview | bytes, count: int) -> np.ndarray:
    """A read-only float32 view over a payload frame, checked against its declared count."""
    return array_view(frame, count, DTYPE)


def array_view(frame: memoryview | bytes, count: int, dtype: np.dtype) -> np.ndarray:
    """A read-only view of dtype over a payload frame, checked against its declared count."""
    nbytes = len(frame)
    if nbytes != count * dtype.itemsize:
        raise errors.ProtocolError(
            f"payload is {nbytes} bytes but the header declares {count} {WIRE_NAMES[dtype]} values"
        )
    return np.frombuffer(frame, dtype=dtype, count=count)


def small_payload(frame: memoryview | bytes) -> bytes:
    """A text or struct payload, refused above MAX_TEXT_BYTES."""
    if len(frame) > MAX_TEXT_BYTES:
        raise errors.ProtocolError(f"text payload of {len(frame)} bytes exceeds {MAX_TEXT_BYTES}")
    return bytes(frame)


def decode_text(frame: memoryview | bytes) -> str:
    return small_payload(frame).decode("utf-8", errors="replace")


def max_frame_bytes(array_values: int) -> int:
    """The largest frame a server of arrays this long accepts (ZMQ_MAXMSGSIZE is per frame)."""
    return max(array_values * DTYPE.itemsize, MAX_TEXT_BYTES, HEADER.size)
