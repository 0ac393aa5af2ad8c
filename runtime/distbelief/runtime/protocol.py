"""The wire protocol between replicas, the chief and the parameter shards.

A message is one fixed-size header frame, optionally followed by one payload frame:

    header   48 bytes, little-endian (see HEADER)
    payload  raw float32 values (pull replies, pushes) or UTF-8 text (errors, stats, done)

The header carries the protocol version, the op, a reply status, the shard index, a
request sequence number, the sender's worker id, the model layout hash, a step, the
number of float32 values in the payload, and for pushes the examples and mean loss the
gradient stands for. Everything a peer sends is checked here before a shard acts on it;
nothing is ever unpickled.
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


def float_view(frame: memoryview | bytes, count: int) -> np.ndarray:
    """A read-only float32 view over a payload frame, checked against its declared count."""
    nbytes = len(frame)
    if nbytes != count * DTYPE.itemsize:
        raise errors.ProtocolError(
            f"payload is {nbytes} bytes but the header declares {count} float32 values"
        )
    return np.frombuffer(frame, dtype=DTYPE, count=count)


def decode_text(frame: memoryview | bytes) -> str:
    if len(frame) > MAX_TEXT_BYTES:
        raise errors.ProtocolError(f"text payload of {len(frame)} bytes exceeds {MAX_TEXT_BYTES}")
    return bytes(frame).decode("utf-8", errors="replace")


def max_message_bytes(slice_size: int) -> int:
    """The largest message a shard of this size accepts (ZMQ_MAXMSGSIZE)."""
    return HEADER.size + max(slice_size * DTYPE.itemsize, MAX_TEXT_BYTES)
