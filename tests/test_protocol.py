"""Unit tests of distbelief.runtime.protocol: the header's round trip, every check a
received header goes through, and the zero-copy payload views."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from distbelief.runtime import errors, protocol
from distbelief.runtime.protocol import HEADER, MAGIC, VERSION, Header, Op, Status

FULL = dict(op=Op.PUSH, shard=65535, layout=2**64 - 1, status=Status.WAIT, seq=2**32 - 1,
            worker=2**32 - 2, step=2**64 - 2, count=10**12, examples=2**32 - 1, loss=1.25)


def raw(magic=MAGIC, version=VERSION, op=Op.PULL, status=Status.OK, shard=1, seq=2, worker=3,
        layout=4, step=5, count=6, examples=7, loss=0.5) -> bytes:
    return HEADER.pack(magic, version, op, status, shard, seq, worker, layout, step, count, examples, loss)


def test_header_is_48_bytes():
    assert HEADER.size == 48
    assert len(Header(op=Op.HELLO, shard=0, layout=0).pack()) == 48


def test_round_trip_of_every_field():
    header = Header(**FULL)
    parsed = protocol.unpack_header(header.pack())
    assert parsed == header
    for field, value in FULL.items():
        assert getattr(parsed, field) == value, field


@pytest.mark.parametrize("field, value", [
    ("shard", 0), ("shard", 40000), ("layout", 0x0123456789ABCDEF), ("seq", 77), ("worker", 9),
    ("step", 123456789012), ("count", 1), ("examples", 128), ("loss", -3.5), ("loss", 2.0**-20),
])
def test_each_field_travels_on_its_own(field, value):
    """Changing one field changes only that field after the round trip (no crossed wires)."""
    base = Header(op=Op.STATS, shard=2, layout=11)
    header = dataclasses.replace(base, **{field: value})
    parsed = protocol.unpack_header(header.pack())
    assert getattr(parsed, field) == value
    for other in ("op", "shard", "layout", "status", "seq", "worker", "step", "count", "examples", "loss"):
        if other != field:
            assert getattr(parsed, other) == getattr(base, other), other


@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("status", list(Status))
def test_round_trip_of_every_op_and_status(op, status):
    parsed = protocol.unpack_header(Header(op=op, status=status, shard=1, layout=2).pack())
    assert parsed.op == op and parsed.status == status


def test_loss_travels_as_float32():
    parsed = protocol.unpack_header(Header(op=Op.PUSH, shard=0, layout=0, loss=0.1).pack())
    assert parsed.loss == pytest.approx(0.1, rel=1e-7)
    assert parsed.loss == float(np.float32(0.1))


def test_unpack_accepts_a_memoryview():
    frame = memoryview(bytearray(Header(**FULL).pack()))
    assert protocol.unpack_header(frame) == Header(**FULL)


def test_reply_keeps_the_request_identity_and_clears_the_push_figures():
    request = Header(**FULL)
    reply = request.reply(status=Status.DONE, step=99, count=12)
    assert (reply.op, reply.shard, reply.seq, reply.layout, reply.worker) == (
        request.op, request.shard, request.seq, request.layout, request.worker)
    assert (reply.status, reply.step, reply.count) == (Status.DONE, 99, 12)
    assert (reply.examples, reply.loss) == (0, 0.0)
    assert protocol.unpack_header(reply.pack()) == reply
    assert request.reply() == Header(op=request.op, shard=request.shard, layout=request.layout,
                                     seq=request.seq, worker=request.worker)


@pytest.mark.parametrize("length", [0, 1, 47, 49, 96])
def test_wrong_length_is_a_protocol_error(length):
    frame = (raw() * 3)[:length]
    with pytest.raises(errors.ProtocolError, match=f"header is {length} bytes, expected 48"):
        protocol.unpack_header(frame)


@pytest.mark.parametrize("magic", [b"XX", b"db", b"\0\0"])
def test_bad_magic_is_a_protocol_error(magic):
    with pytest.raises(errors.ProtocolError, match="bad magic") as info:
        protocol.unpack_header(raw(magic=magic))
    assert repr(magic) in str(info.value)


@pytest.mark.parametrize("version", [0, 2, 255])
def test_other_version_is_a_protocol_error(version):
    with pytest.raises(errors.ProtocolError, match=f"protocol version {version}, this peer speaks {VERSION}"):
        protocol.unpack_header(raw(version=version))


@pytest.mark.parametrize("op", [0, max(Op) + 1, 255])
def test_unknown_op_is_a_protocol_error(op):
    with pytest.raises(errors.ProtocolError, match=f"unknown op {op}$"):
        protocol.unpack_header(raw(op=op))


@pytest.mark.parametrize("status", [max(Status) + 1, 200, 255])
def test_unknown_status_is_a_protocol_error(status):
    with pytest.raises(errors.ProtocolError, match=f"unknown status {status}$"):
        protocol.unpack_header(raw(status=status))


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_loss_is_a_protocol_error(loss):
    with pytest.raises(errors.ProtocolError, match="loss is not a finite number"):
        protocol.unpack_header(raw(loss=loss))


def test_protocol_errors_are_runtime_failures():
    with pytest.raises(errors.RuntimeFailure):
        protocol.unpack_header(b"")


# --- payloads ----------------------------------------------------------------------------

@pytest.mark.parametrize("count, nbytes", [(10, 36), (10, 44), (10, 41), (0, 4), (1, 0), (-1, 4)])
def test_float_view_rejects_a_size_that_does_not_match_the_count(count, nbytes):
    with pytest.raises(errors.ProtocolError, match=f"payload is {nbytes} bytes but the header declares {count} float32"):
        protocol.float_view(b"\0" * nbytes, count)


def test_float_view_is_a_zero_copy_view():
    values = np.arange(1000, dtype="<f4") / 3
    buffer = bytearray(values.tobytes())
    view = protocol.float_view(memoryview(buffer), 1000)
    assert view.dtype == np.dtype("<f4") and view.shape == (1000,)
    np.testing.assert_array_equal(view, values)
    assert np.shares_memory(view, np.frombuffer(buffer, dtype=np.uint8))
    buffer[0:4] = struct.pack("<f", 42.0)  # a change to the frame shows through
    assert view[0] == 42.0


def test_float_view_over_bytes_is_read_only():
    view = protocol.float_view(np.ones(4, dtype="<f4").tobytes(), 4)
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0] = 2.0


def test_float_view_of_an_empty_payload():
    assert protocol.float_view(b"", 0).shape == (0,)


def test_decode_text():
    assert protocol.decode_text("shard 2: layout mismatch ✓".encode()) == "shard 2: layout mismatch ✓"
    assert protocol.decode_text(memoryview(b"ok")) == "ok"
    assert protocol.decode_text(b"bad \xff byte") == "bad \ufffd byte"  # never raises on bad UTF-8
    assert len(protocol.decode_text(b"x" * protocol.MAX_TEXT_BYTES)) == protocol.MAX_TEXT_BYTES
    with pytest.raises(errors.ProtocolError, match="exceeds"):
        protocol.decode_text(b"x" * (protocol.MAX_TEXT_BYTES + 1))


@pytest.mark.parametrize("slice_size, expected", [
    (0, 48 + 64 * 1024),
    (10, 48 + 64 * 1024),
    (16 * 1024, 48 + 64 * 1024),
    (16 * 1024 + 1, 48 + 64 * 1024 + 4),
    (1_000_000, 48 + 4_000_000),
])
def test_max_message_bytes(slice_size, expected):
    assert protocol.max_message_bytes(slice_size) == expected
