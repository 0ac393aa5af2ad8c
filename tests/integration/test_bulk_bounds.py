"""The bulk port's bounds per peer and per shard (distbelief.runtime.transport.bulk_port),
against a hostile peer that holds the replicas' key and so gets sessions as a replica does:
many connections of one peer, many sessions each declaring the largest message and
trickling its bytes, connections that never send a hello, and TCP connections to the
ZeroMQ port that never handshake. Each time the shard's memory stays within its bound, the
extra connections are closed (seen from the peer's side), and a replica trains meanwhile."""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
import zmq

from distbelief.runtime import keys
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.transport import bulk_port, framing, sessions, zmq_server
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.protocol import Header

from support.memory import rss_bytes
from support.shards import LiveShards, start_shards
from support.waiting import eventually

LAYOUT = Layout.of([("w", (1_000_000,))], shards=1)  # a 4 MB slice: the port's budget is 16 MB
FRAME = protocol.max_frame_bytes(LAYOUT.size(0)) + sessions.TAG_BYTES  # the largest frame the bulk port takes
LARGEST = 3 * FRAME                                  # the largest message it takes: 12 MB
MiB = 1 << 20
# Growth of the shard's (this process's) memory under each attack, as docs/security.md states it.
TRICKLE_RSS_BOUND = 64 * MiB   # the budget (16 MB), the buffers the port keeps, the replica's traffic
CONNECTIONS_RSS_BOUND = 16 * MiB


@pytest.fixture
def live(tmp_path: Path, job_keys: keys.JobKeys) -> Iterator[LiveShards]:
    shards = start_shards(tmp_path, LAYOUT, np.zeros(LAYOUT.total, np.float32), checkpoint_every=3600,
                          security=job_keys.server_security(), bulk_bind="tcp://127.0.0.1:*")
    yield shards
    shards.stop()


@pytest.fixture
def replica(live: LiveShards, job_keys: keys.JobKeys) -> Iterator[ShardGroup]:
    """A legitimate replica, its session, bulk connection and buffers (and the shard's) in
    place after a first step: the baseline of the tests' memory figures."""
    group = live.group(security=job_keys.client_options(), timeouts=Timeouts(request=10.0, unavailable=120.0))
    assert _train(group, 1) == 1
    yield group
    group.close()


def _train(group: ShardGroup, steps: int) -> int:
    """A pull, then `steps` pushes of a replica, each with its pull; the shard's step after the last."""
    out = np.zeros(LAYOUT.total, np.float32)
    step = Float32Dense(group).pull(out)[0].step
    for _ in range(steps):
        grad = np.ones(LAYOUT.total, np.float32)
        step = Float32Dense(group).push_and_pull(grad, out, steps=[step], examples=1, loss=0.5)[0].step
    return step


@dataclasses.dataclass
class Hostile:
    """A holder of the replicas' key: CurveZMQ connections to the shard (each a peer of its
    own) that ask for sessions, and raw TCP connections to its bulk port."""

    address: str
    options: dict
    dealers: list[zmq.Socket] = dataclasses.field(default_factory=list)
    connections: list[socket.socket] = dataclasses.field(default_factory=list)
    port: int = 0

    def peer(self) -> zmq.Socket:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        for option, value in self.options.items():
            dealer.setsockopt(option, value)
        dealer.connect(self.address)
        self.dealers.append(dealer)
        return dealer

    def session(self, dealer: zmq.Socket) -> sessions.Session:
        """A session granted to `dealer`'s peer, as a replica asks for one."""
        dealer.send(sessions.SESSION_MAGIC)
        assert dealer.poll(10_000), "no session granted"
        grant = sessions.parse_grant(dealer.recv())
        assert grant is not None
        session, self.port = grant
        return session

    def connect(self) -> socket.socket:
        conn = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        self.connections.append(conn)
        return conn

    def close(self) -> None:
        for conn in self.connections:
            conn.close()
        for dealer in self.dealers:
            dealer.close()


@pytest.fixture
def hostile(live: LiveShards, job_keys: keys.JobKeys) -> Iterator[Hostile]:
    attacker = Hostile(live.addresses[0], job_keys.client_options())
    yield attacker
    attacker.close()


def _request(session: sessions.Session, seq: int) -> bytes:
    """A sealed HELLO op: a small request any replica may send."""
    header = Header(op=protocol.HELLO.code, shard=0, layout=LAYOUT.hash, seq=seq)
    return bytes(session.seal_into(sessions.TO_SERVER, [header.pack()], framing.BufferPool(keep=0))[0])


def _answered(conn: socket.socket, session: sessions.Session, seq: int) -> bool:
    """Whether the shard answers a request of `session` on `conn`."""
    conn.sendall(_request(session, seq))
    conn.settimeout(10)
    try:
        return bool(conn.recv(1 << 16))
    except (TimeoutError, ConnectionResetError):
        return False


def _closed(conn: socket.socket) -> bool:
    """Whether the shard closed `conn`, without waiting: its end reads as b'' or a reset."""
    conn.setblocking(False)
    try:
        while data := conn.recv(1 << 16):
            del data
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _all_closed(connections: list[socket.socket]) -> Callable[[], bool]:
    return lambda: all(_closed(conn) for conn in connections)


def _head(session: sessions.Session, lengths: list[int]) -> bytes:
    """A message's head declaring frames of `lengths`, vouched for under the session's key."""
    session.sent += 1
    head = framing.HEAD.pack(session.id, session.sent, len(lengths)) + b"".join(struct.pack("<I", n) for n in lengths)
    return head + session.head_tag(sessions.TO_SERVER, session.sent, head)


def test_a_peer_keeps_two_bulk_connections_across_its_sessions(live: LiveShards, replica: ShardGroup,
                                                               hostile: Hostile) -> None:
    """20 connections under one session, then one under each of two more sessions of the
    same peer, each admitted and answered: every hello beyond the peer's second connection
    closes its oldest, so the last two alone stay open."""
    before = rss_bytes()
    dealer = hostile.peer()
    opened = []
    for session in [hostile.session(dealer)] * 20 + [hostile.session(dealer) for _ in range(2)]:
        conn = hostile.connect()
        conn.sendall(session.hello())
        assert _answered(conn, session, seq=len(opened)), "an admitted connection is answered"
        opened.append((conn, session))
    eventually(_all_closed([conn for conn, _ in opened[:-2]]), 30, what="all but the newest two closed")
    assert all(_answered(conn, session, seq=100 + i) for i, (conn, session) in enumerate(opened[-2:]))
    assert _train(replica, 3) == 4
    assert rss_bytes() - before < CONNECTIONS_RSS_BOUND


def test_trickled_messages_of_many_sessions_are_held_to_the_port_budget(
        live: LiveShards, replica: ShardGroup, hostile: Hostile, monkeypatch: pytest.MonkeyPatch) -> None:
    """16 peers, 2 sessions each, a connection per session declaring the largest message
    (12 MB) and trickling its bytes: 384 MB if each got its buffer. The port buffers at most
    its budget (16 MB), a message that has held it over HOLD_SECONDS while others wait is
    closed (all but the last, which keeps no one waiting), and the replica's pushes, let in
    first as the newest waiters, go through meanwhile."""
    monkeypatch.setattr(bulk_port, "HOLD_SECONDS", 0.5)
    before = rss_bytes()
    trickling = []
    for _ in range(16):
        dealer = hostile.peer()
        for session in (hostile.session(dealer), hostile.session(dealer)):
            conn = hostile.connect()
            conn.sendall(session.hello() + _head(session, [FRAME] * 3) + bytes(64 << 10))
            trickling.append(conn)
    peak, stop = [0], threading.Event()

    def trickle() -> None:
        while not stop.wait(0.1):
            for conn in trickling:
                try:
                    conn.send(bytes(1024), socket.MSG_DONTWAIT)
                except OSError:  # closed by the shard (seen by _closed), or its socket full
                    pass
            peak[0] = max(peak[0], rss_bytes() - before)
    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        assert _train(replica, 5) == 6
        eventually(lambda: sum(_closed(conn) for conn in trickling) >= len(trickling) - 1, 120,
                   what="every trickling connection but the last closed in its turn")
    finally:
        stop.set()
        thread.join()
    assert peak[0] < TRICKLE_RSS_BOUND, f"RSS grew by {peak[0]} bytes"


def test_connections_that_never_send_a_hello_are_closed_on_a_timer(
        live: LiveShards, replica: ShardGroup, hostile: Hostile, monkeypatch: pytest.MonkeyPatch) -> None:
    """100 connections to the bulk port, half of them with half a hello, then no one else
    connects: the oldest beyond 64 are closed at once, and the rest after HELLO_SECONDS."""
    monkeypatch.setattr(bulk_port, "HELLO_SECONDS", 1.0)
    hostile.session(hostile.peer())  # to learn the port
    before = rss_bytes()
    silent = [hostile.connect() for _ in range(100)]
    for conn in silent[::2]:
        conn.sendall(framing.HELLO_MAGIC)
    assert _train(replica, 3) == 4
    eventually(_all_closed(silent), 30, what="every connection without a hello closed")
    assert rss_bytes() - before < CONNECTIONS_RSS_BOUND


def test_tcp_connections_to_the_zeromq_port_that_never_handshake_are_dropped(
        live: LiveShards, replica: ShardGroup) -> None:
    """100 TCP connections to the shard's CurveZMQ port, half of them with the start of a
    ZMTP greeting, none completing the handshake: libzmq drops each after HANDSHAKE_MS."""
    assert zmq_server.HANDSHAKE_MS == 10_000
    host, port = live.addresses[0].removeprefix("tcp://").rsplit(":", 1)
    before = rss_bytes()
    silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(100)]
    try:
        for conn in silent[::2]:
            conn.sendall(b"\xff" + bytes(8) + b"\x7f")  # ZMTP's signature, and nothing after it
        assert _train(replica, 3) == 4
        eventually(_all_closed(silent), 60, what="every silent connection dropped")
        assert rss_bytes() - before < CONNECTIONS_RSS_BOUND
    finally:
        for conn in silent:
            conn.close()
