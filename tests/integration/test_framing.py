"""The bulk channel's framing (distbelief.runtime.transport.framing) on real loopback TCP
connections: messages arrive whole however the bytes are cut, large ones go through
non-blocking sockets, buffers are reused, and the limits hold before anything is buffered."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import Iterator

import pytest

from distbelief.runtime import contract, errors
from distbelief.runtime.transport import framing, localsocket

LIMITS = framing.Limits(max_frames=4, max_frame=80 << 20)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Both ends of a TCP connection on loopback."""
    listener = framing.listen("tcp://127.0.0.1:*")
    client = socket.create_connection(listener.getsockname())
    listener.setblocking(True)
    server, _ = listener.accept()
    listener.close()
    yield client, server
    client.close()
    server.close()


def _message(frames: list[bytes], session_id: bytes = b"s" * 16, counter: int = 7) -> bytes:
    head = framing.HEAD.pack(session_id, counter, len(frames)) + b"".join(struct.pack("<I", len(f)) for f in frames)
    return head + bytes(framing.HEAD_TAG) + b"".join(frames)  # a tag no check_head looks at here


def _pump_until_whole(stream: framing.Stream, *others: framing.Stream, seconds: float = 20.0) -> framing.Message:
    deadline = time.monotonic() + seconds
    while stream.message is None:
        assert time.monotonic() < deadline, "no whole message in time"
        for other in others:
            other.flush()
        stream.pump()
        assert not stream.closed
    return stream.message


def test_a_message_cut_into_single_bytes_arrives_whole(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stream = framing.Stream(server, LIMITS, framing.BufferPool(keep=1), expects_hello=False)
    frames = [b"header", b"", bytes(range(256)) * 3]
    for byte in _message(frames):
        client.send(bytes([byte]))
        stream.pump()
    message = _pump_until_whole(stream)
    assert (message.session_id, message.counter) == (b"s" * 16, 7)
    assert [bytes(f) for f in message.frames()] == frames


def test_a_large_message_goes_through_non_blocking_sockets_into_a_reused_buffer(
        pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    sender = framing.Stream(client, LIMITS, framing.BufferPool(keep=1), expects_hello=False)
    receiver = framing.Stream(server, LIMITS, framing.BufferPool(keep=1), expects_hello=False)
    payload = bytes(range(251)) * ((64 << 20) // 251)  # 64 MiB: many times the sockets' buffers
    buffers = []
    for counter in (1, 2):
        sender.send(memoryview(_message([b"h", payload], counter=counter)))
        assert sender.queued == 1  # the socket took part of it; the rest waits
        message = _pump_until_whole(receiver, sender)
        assert message.counter == counter and bytes(message.frames()[1]) == payload
        buffers.append(message.body.obj)
        receiver.done()
    assert buffers[0] is buffers[1]  # the second message went into the first one's pages


@pytest.mark.parametrize("frames, reason", [
    ([b"x"] * 5, "a message of 5 frames"),
    ([b"x" * (LIMITS.max_frame + 1)], f"a frame of {LIMITS.max_frame + 1} bytes"),
])
def test_a_message_over_the_limits_is_refused_before_its_frames_are_read(
        pair: tuple[socket.socket, socket.socket], frames: list[bytes], reason: str) -> None:
    client, server = pair
    pool = framing.BufferPool(keep=1)
    stream = framing.Stream(server, LIMITS, pool, expects_hello=False)
    wire = _message(frames)
    client.sendall(wire[:framing.HEAD.size + 4 * len(frames) + framing.HEAD_TAG + 10])  # the head and a little
    with pytest.raises(errors.BulkRejected, match=reason):
        _pump_until_whole(stream)
    assert stream.message is None and len(stream._body) == 0  # no buffer was taken for the frames


def test_a_hello_holds_the_reading_until_it_is_admitted(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    stream = framing.Stream(server, LIMITS, framing.BufferPool(keep=1), expects_hello=True)
    hello = framing.HELLO.pack(framing.HELLO_MAGIC, b"s" * 16, 1, b"t" * 16)
    client.sendall(hello + _message([b"after"]))
    deadline = time.monotonic() + 10
    while stream.hello is None:
        assert time.monotonic() < deadline
        stream.pump()
    assert stream.hello == hello
    stream.pump()
    assert stream.message is None  # not a byte past the hello is read before admit()
    stream.admit(owner="peer")
    assert [bytes(f) for f in _pump_until_whole(stream).frames()] == [b"after"]


def test_a_loopback_connection_goes_to_the_unix_socket_of_the_port_and_falls_back_to_tcp(
        private_sockets: Path) -> None:
    listener = framing.listen("tcp://127.0.0.1:*")
    port = listener.getsockname()[1]
    try:
        tcp = framing.connect("127.0.0.1", port)  # no Unix socket for this port yet: TCP
        assert tcp.family == socket.AF_INET
        tcp.close()
        local = localsocket.listen_local(port)
        assert local is not None and (private_sockets / f"bulk-{port}").exists()
        unix = framing.connect("127.0.0.1", port)
        assert unix.family == socket.AF_UNIX
        unix.close()
        remote = framing.connect("127.0.0.2", port)  # another address (a proxy, say) keeps to TCP
        assert remote.family == socket.AF_INET
        remote.close()
        localsocket.unlink_local(local)
        assert not (private_sockets / f"bulk-{port}").exists()
    finally:
        listener.close()


def test_a_live_holder_of_the_socket_name_makes_the_port_refuse_and_a_dead_one_is_replaced(
        private_sockets: Path) -> None:
    holder = localsocket.listen_local(40000)
    assert holder is not None
    with pytest.raises(errors.ConfigError, match="bulk-40000.*taken by a live process"):
        localsocket.listen_local(40000)
    holder.close()  # as a SIGKILL leaves it: the name stays, nothing answers
    assert (private_sockets / "bulk-40000").exists()
    again = localsocket.listen_local(40000)
    assert again is not None
    localsocket.unlink_local(again)


def test_a_socket_folder_others_may_use_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv(contract.ENV_SOCKET_DIR, str(shared))
    with pytest.raises(errors.ConfigError, match="must be a folder only its owner may use"):
        localsocket.listen_local(40001)
    monkeypatch.delenv(contract.ENV_SOCKET_DIR)
    assert localsocket.listen_local(40001) is None  # no folder (a cluster's pods): TCP only


def test_a_head_its_owner_does_not_vouch_for_is_refused_before_its_frames_are_read(
        pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    vetted = []

    def refuse(stream: framing.Stream, head: bytes, tag: bytes) -> None:
        vetted.append((head, tag))
        raise errors.BulkRejected("a message head that failed its authentication tag")
    stream = framing.Stream(server, LIMITS, framing.BufferPool(keep=1), expects_hello=False, check_head=refuse)
    wire = _message([b"x" * 1000])
    client.sendall(wire)
    with pytest.raises(errors.BulkRejected, match="head that failed"):
        _pump_until_whole(stream)
    assert vetted == [(wire[:framing.HEAD.size + 4], bytes(framing.HEAD_TAG))]
    assert len(stream._body) == 0
