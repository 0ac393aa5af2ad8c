"""Unit tests of distbelief.runtime.wire.protocol: the header's round trip, every check a
received header goes through, and the zero-copy payload views."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from distbelief.runtime import errors
from distbelief.runtime.algorithms.sandblaster import ops as sandblaster_ops
from distbelief.runtime.params import dense
from distbelief.runtime.shard.copies import replication  # noqa: F401  (defines the copies' ops)
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import HEADER, MAGIC, VERSION, ErrorCode, Header, OpSpec, Status

FULL = dict(op=dense.PUSH.code, shard=65535, layout=2**64 - 1, status=Status.WAIT, error=ErrorCode.STATE,
            seq=2**32 - 1, worker=2**32 - 2, step=2**64 - 2, count=10**12)
UPDATE = dense.Update(examples=8, loss=0.5)


def raw(magic=MAGIC, version=VERSION, op=dense.PULL.code, status=Status.OK, error=0, shard=1, seq=2, worker=3,
        layout=4, step=5, count=6) -> bytes:
    return HEADER.pack(magic, version, op, status, error, shard, seq, worker, layout, step, count)


def test_header_is_40_bytes():
    assert HEADER.size == 40
    assert len(Header(op=protocol.HELLO.code, shard=0, layout=0).pack()) == 40


def test_round_trip_of_every_field():
    header = Header(**FULL)
    parsed = protocol.unpack_header(header.pack())
    assert parsed == header
    for field, value in FULL.items():
        assert getattr(parsed, field) == value, field


@pytest.mark.parametrize("field, value", [
    ("shard", 0), ("shard", 40000), ("layout", 0x0123456789ABCDEF), ("seq", 77), ("worker", 9),
    ("step", 123456789012), ("count", 1), ("error", ErrorCode.LAYOUT),
])
def test_each_field_travels_on_its_own(field, value):
    """Changing one field changes only that field after the round trip (no crossed wires)."""
    base = Header(op=protocol.STATS.code, shard=2, layout=11)
    header = dataclasses.replace(base, **{field: value})
    parsed = protocol.unpack_header(header.pack())
    assert getattr(parsed, field) == value
    for other in ("op", "shard", "layout", "status", "error", "seq", "worker", "step", "count"):
        if other != field:
            assert getattr(parsed, other) == getattr(base, other), other


@pytest.mark.parametrize("op", sorted(protocol.OPS))
@pytest.mark.parametrize("status", list(Status))
def test_round_trip_of_every_op_and_status(op, status):
    parsed = protocol.unpack_header(Header(op=op, status=status, shard=1, layout=2).pack())
    assert parsed.op == op and parsed.status == status


def test_every_algorithm_op_is_registered_once_with_its_own_code():
    names = [spec.name for spec in protocol.OPS.values()]
    assert len(names) == len(set(names))
    for spec in (protocol.HELLO, dense.PUSH_PULL, sandblaster_ops.WORK, sandblaster_ops.VECTOR):
        assert protocol.OPS[spec.code] is spec


def test_an_op_code_cannot_be_taken_twice():
    with pytest.raises(ValueError, match="op code 3 is taken by PUSH"):
        protocol.define(OpSpec(3, "MINE"))


def test_unpack_accepts_a_memoryview():
    frame = memoryview(bytearray(Header(**FULL).pack()))
    assert protocol.unpack_header(frame) == Header(**FULL)


def test_reply_keeps_the_request_identity():
    request = Header(**{**FULL, "status": Status.OK, "error": 0})
    reply = request.reply(status=Status.DONE, step=99, count=12)
    assert (reply.op, reply.shard, reply.seq, reply.layout, reply.worker) == (
        request.op, request.shard, request.seq, request.layout, request.worker)
    assert (reply.status, reply.step, reply.count, reply.error) == (Status.DONE, 99, 12, 0)
    assert protocol.unpack_header(reply.pack()) == reply


@pytest.mark.parametrize("length", [0, 1, 39, 41, 96])
def test_wrong_length_is_a_protocol_error(length):
    frame = (b"\0" * 200)[:length]
    with pytest.raises(errors.ProtocolError, match=f"header is {length} bytes, expected 40"):
        protocol.unpack_header(frame)


@pytest.mark.parametrize("magic", [b"XX", b"db", b"\0\0"])
def test_bad_magic_is_a_protocol_error(magic):
    with pytest.raises(errors.ProtocolError, match="bad magic") as info:
        protocol.unpack_header(raw(magic=magic))
    assert repr(magic) in str(info.value)


@pytest.mark.parametrize("version", [0, 1, 3, 255])
def test_other_version_is_a_protocol_error_naming_both(version):
    with pytest.raises(errors.ProtocolError, match=f"speaks protocol version {version}, this one speaks {VERSION}"):
        protocol.unpack_header(raw(version=version))


def test_a_version_1_peer_is_told_in_its_own_header_format():
    v1_request = protocol.V1_HEADER.pack(MAGIC, 1, 3, 0, 1, 77, 9, 1234, 0, 10, 8, 0.5)
    answer = protocol.old_version_refusal(v1_request)
    magic, version, op, status, shard, seq, worker, layout, *_ = protocol.V1_HEADER.unpack(answer)
    assert (magic, version, op, status, shard, seq, worker, layout) == (MAGIC, 1, 3, protocol.V1_ERROR, 1, 77, 9, 1234)
    assert protocol.old_version_refusal(Header(**FULL).pack()) is None
    assert b"version 2" in protocol.version_refusal_text()


@pytest.mark.parametrize("op", [0, 255, 200])
def test_unknown_op_is_a_protocol_error(op):
    with pytest.raises(errors.ProtocolError, match=f"unknown op {op}$"):
        protocol.unpack_header(raw(op=op))


@pytest.mark.parametrize("status", [max(Status) + 1, 200, 255])
def test_unknown_status_is_a_protocol_error(status):
    with pytest.raises(errors.ProtocolError, match=f"unknown status {status}$"):
        protocol.unpack_header(raw(status=status))


def test_unknown_error_code_is_a_protocol_error():
    with pytest.raises(errors.ProtocolError, match="unknown error code 99"):
        protocol.unpack_header(raw(error=99))


# --- whole requests ----------------------------------------------------------------------

def _push(count: int = 3, **header: int) -> list:
    return [Header(op=dense.PUSH.code, shard=0, layout=1, count=count, **header).pack(), UPDATE.pack(),
            np.ones(3, np.float32).tobytes()]


def test_a_push_parses_into_its_payload_and_array():
    message = protocol.parse_request(_push())
    assert message.spec is dense.PUSH and message.meta == UPDATE
    np.testing.assert_array_equal(message.array, np.ones(3))


@pytest.mark.parametrize("frames, problem", [
    (lambda: _push()[:2], "PUSH carries 2 frames after its header, got 1"),
    (lambda: _push() + [b"x"], "PUSH carries 2 frames after its header, got 3"),
    (lambda: _push(count=4), "payload is 12 bytes but the header declares 4"),
    (lambda: [_push()[0], b"\0" * 7, _push()[2]], "Update is 7 bytes, expected 8"),
    (lambda: _push(status=Status.ERROR), "a request must have status OK"),
    (lambda: [Header(op=dense.PULL.code, shard=0, layout=1, count=5).pack()], "PULL carries no array"),
])
def test_a_malformed_request_names_its_problem(frames, problem):
    with pytest.raises(errors.ProtocolError, match=problem):
        protocol.parse_request(frames())


@pytest.mark.parametrize("update, problem", [
    (struct.pack("<If", 0, 1.0), "1..16777216 examples"),
    (struct.pack("<If", 2**32 - 1, 1.0), "1..16777216 examples"),
    (struct.pack("<If", 8, float("nan")), "loss is not a finite number"),
    (struct.pack("<If", 8, float("inf")), "loss is not a finite number"),
])
def test_a_push_stands_for_a_bounded_count_of_examples_and_a_finite_loss(update, problem):
    with pytest.raises(errors.ProtocolError, match=problem):
        dense.Update.unpack(update)


def test_a_work_request_may_carry_a_result_or_none():
    header = Header(op=sandblaster_ops.WORK.code, shard=0, layout=1).pack()
    assert protocol.parse_request([header]).meta is None
    result = sandblaster_ops.UnitResult(evaluation=1, unit=2, examples=3, loss=0.5)
    assert protocol.parse_request([header, result.pack()]).meta == result


def test_json_payloads_must_be_objects_of_bounded_size():
    assert protocol.JsonObject.unpack(b'{"a": 1}').value == {"a": 1}
    for bad, problem in ((b"[1]", "must be an object"), (b"{", "unreadable JSON"),
                         (b" " * (protocol.MAX_TEXT_BYTES + 1), "exceeds")):
        with pytest.raises(errors.ProtocolError, match=problem):
            protocol.JsonObject.unpack(bad)


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


@pytest.mark.parametrize("values, expected", [
    (0, 64 * 1024), (10, 64 * 1024), (16 * 1024, 64 * 1024), (16 * 1024 + 1, 64 * 1024 + 4),
    (1_000_000, 4_000_000),
])
def test_max_frame_bytes(values, expected):
    assert protocol.max_frame_bytes(values) == expected
