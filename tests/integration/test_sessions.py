"""The bulk channel of encrypted jobs (distbelief.runtime.transport.sessions): AES-256-GCM sessions
agreed over CurveZMQ, on TCP connections of our own framing (framing.py). Live shards on
loopback; the attacker writes raw bytes to the bulk port, with or without a session's key."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import struct
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import zmq

from distbelief.runtime import errors, keys
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.params import dense
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.transport import framing, sessions, zmq_transport
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Header

from support.memory import observed, rss_bytes
from support.shards import LiveShards, start_shards
from support.waiting import eventually

LAYOUT = Layout.of([("w", (300, 7)), ("b", (7,))], shards=2)
INITIAL = np.arange(LAYOUT.total, dtype=np.float32) / 1000
TIMEOUTS = Timeouts(request=2.0, unavailable=10.0)


@pytest.fixture
def job_keys() -> keys.JobKeys:
    return keys.JobKeys.generate()


def _start(tmp_path: Path, job_keys: keys.JobKeys, *, bulk: bool) -> LiveShards:
    return start_shards(tmp_path, LAYOUT, INITIAL, learning_rate=0.5, checkpoint_every=3600,
                        security=job_keys.server_security(), bulk_bind="tcp://127.0.0.1:*" if bulk else None)


@pytest.fixture
def live(tmp_path: Path, job_keys: keys.JobKeys) -> Iterator[LiveShards]:
    shards = _start(tmp_path, job_keys, bulk=True)
    yield shards
    shards.stop()


def _group(live: LiveShards, job_keys: keys.JobKeys, role: str = keys.REPLICA) -> ShardGroup:
    return ShardGroup(live.addresses, LAYOUT, timeouts=TIMEOUTS, security=job_keys.client_options(role=role))


def _train(group: ShardGroup) -> list[np.ndarray]:
    """What a replica sees over a few steps: every pull, and the parameters after pushes."""
    seen, out = [], np.zeros(LAYOUT.total, np.float32)
    steps = [r.step for r in Float32Dense(group).pull(out)]
    seen.append(out.copy())
    for k in range(3):
        grad = np.sin(np.arange(LAYOUT.total, dtype=np.float32) + k)
        steps = [r.step for r in Float32Dense(group).push_and_pull(grad, out, steps=steps, examples=4, loss=0.5)]
        seen.append(out.copy())
    Float32Dense(group).push(np.ones(LAYOUT.total, np.float32), steps=steps, examples=1, loss=0.1)
    Float32Dense(group).pull(out)
    seen.append(out.copy())
    return seen


def test_pulls_and_pushes_over_sessions_match_curvezmq_alone(tmp_path: Path, job_keys: keys.JobKeys,
                                                            private_sockets: Path) -> None:
    results = {}
    for bulk in (True, False):
        live = _start(tmp_path / str(bulk), job_keys, bulk=bulk)
        group = _group(live, job_keys)
        try:
            results[bulk] = _train(group)
            assert all((link.session is not None) is bulk for link in group._links)
            if bulk:  # shards on this machine, with a socket folder: their Unix sockets
                assert {link.bulk_family for link in group._links} == {socket.AF_UNIX}
            assert [s.step for s in live.shards] == [4, 4]
        finally:
            group.close()
            live.stop()
    for with_sessions, curve_only in zip(results[True], results[False]):
        np.testing.assert_array_equal(with_sessions, curve_only)


def _session_of(group: ShardGroup, shard: int = 0) -> tuple[sessions.Session, str]:
    """A copy of the session a group's link holds with a shard, and the bulk port's address."""
    link = group._links[shard]
    assert link.session is not None, "the link has no session yet"
    held = link.session
    copy = sessions.Session(id=held.id, key=held.key, sent=held.sent)
    return copy, link.bulk_endpoint


def _push_frames(step: int = 0, seq: int = 777) -> list[bytes]:
    header = Header(op=dense.PUSH.code, shard=0, layout=LAYOUT.hash, seq=seq, worker=99, step=step,
                    count=LAYOUT.bounds(0)[1])
    grad = np.ones(LAYOUT.bounds(0)[1], np.float32)
    return [header.pack(), dense.Update(examples=1, loss=1.0).pack(), grad.tobytes()]


def _sealed(session: sessions.Session, frames: list[bytes]) -> list[bytes]:
    """A message's frames, each sealed as the bulk channel seals it (its head left out).
    The tests re-tag the heads they alter with the key, so that the frames' own tags are what
    is tested; an attacker without the key fails at the head already (head_untagged)."""
    data = bytes(session.seal_into(sessions.TO_SERVER, frames, framing.BufferPool(keep=0))[0])
    lengths = struct.unpack_from(f"<{len(frames)}I", data, framing.HEAD.size)
    offset, sealed = framing.HEAD.size + 4 * len(frames) + framing.HEAD_TAG, []
    for length in lengths:
        sealed.append(data[offset:offset + length])
        offset += length
    return sealed


def _message(session: sessions.Session, session_id: bytes, counter: int, sealed: list[bytes],
             tagged: bool = True) -> bytes:
    """A message as it goes on the wire: HEAD, each frame's length, their tag under
    `session` (or a wrong one), the frames."""
    head = framing.HEAD.pack(session_id, counter, len(sealed)) + b"".join(struct.pack("<I", len(f)) for f in sealed)
    tag = session.head_tag(sessions.TO_SERVER, counter, head) if tagged else bytes(framing.HEAD_TAG)
    return head + tag + b"".join(sealed)


def _seal(session: sessions.Session, frames: list[bytes]) -> bytes:
    return bytes(session.seal_into(sessions.TO_SERVER, frames, framing.BufferPool(keep=0))[0])


class RawPeer:
    """A TCP connection to a bulk port that writes whatever it is given."""

    def __init__(self, address: str) -> None:
        host, port = framing.split_address(address)
        self.socket = socket.create_connection((host, port), timeout=5)

    def send(self, data: bytes) -> None:
        self.socket.sendall(data)

    def reply(self, seconds: float) -> bytes | None:
        """The bytes of a reply, or None if none came in `seconds` or the server closed the connection."""
        self.socket.settimeout(seconds)
        try:
            return self.socket.recv(1 << 16) or None
        except (TimeoutError, ConnectionResetError):
            return None

    def closed_by_server(self, seconds: float = 5.0) -> bool:
        self.socket.settimeout(seconds)
        try:
            while self.socket.recv(1 << 16):
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.socket.close()


def _still_serving(live: LiveShards, group: ShardGroup, step: int) -> None:
    """Shard 0 is at `step`, and answers an honest push after whatever came before."""
    params = live.params(0).copy()
    steps = [s.step for s in live.shards]
    assert steps[0] == step
    replies = Float32Dense(group).push(np.zeros(LAYOUT.total, np.float32), steps=steps, examples=1, loss=0.0)
    assert replies[0].step == step + 1
    np.testing.assert_array_equal(live.params(0), params)  # a zero gradient moves nothing


@pytest.fixture
def group(live: LiveShards, job_keys: keys.JobKeys) -> Iterator[ShardGroup]:
    """A replica's group whose links hold sessions (a first pull asked for them)."""
    replica = _group(live, job_keys)
    Float32Dense(replica).pull(np.zeros(LAYOUT.total, np.float32))
    yield replica
    replica.close()


@pytest.fixture
def raw_peer(group: ShardGroup) -> Iterator[RawPeer]:
    """A peer on shard 0's bulk port that never did a CurveZMQ handshake."""
    peer = RawPeer(_session_of(group)[1])
    yield peer
    peer.close()


def _proven(peer: RawPeer, session: sessions.Session) -> RawPeer:
    """The peer's connection admitted: its hello proves the session."""
    peer.send(session.hello())
    return peer


def test_a_sealed_push_is_applied_once_and_its_replay_is_refused(live: LiveShards, group: ShardGroup,
                                                                  raw_peer: RawPeer,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    session, _ = _session_of(group)
    _proven(raw_peer, session)
    sealed = _seal(session, _push_frames(seq=1))  # before the group's next command
    raw_peer.send(sealed)
    assert raw_peer.reply(5.0) is not None  # whoever holds the session key is answered...
    assert live.shards[0].step == 1
    before = live.params(0).copy()
    with caplog.at_level(logging.WARNING):
        raw_peer.send(sealed)  # ...and a copy of its message, sent again, is refused
        assert raw_peer.closed_by_server()
    assert "replayed or reordered" in caplog.text
    np.testing.assert_array_equal(live.params(0), before)
    group._links[0].reconnect()  # its counter is behind the copy's: a fresh connection, a new session
    _still_serving(live, group, step=1)


@pytest.mark.parametrize("damage", ["flipped_bit", "frames_swapped", "frame_dropped", "other_session",
                                    "head_untagged"])
def test_a_forged_or_altered_bulk_message_is_refused(live: LiveShards, job_keys: keys.JobKeys, group: ShardGroup,
                                                      raw_peer: RawPeer, damage: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    session, _ = _session_of(group)
    proving = session
    if damage == "other_session":  # a message sealed under one session, sent under another's id,
        other = _group(live, job_keys)  # on a connection that proved that other one
        Float32Dense(other).pull(np.zeros(LAYOUT.total, np.float32))
        proving = _session_of(other)[0]
        other.close()
    _proven(raw_peer, proving)
    sealed = _sealed(session, _push_frames())
    session_id, counter = session.id, session.sent  # the counter it was sealed under
    if damage == "flipped_bit":
        array = bytearray(sealed[2])
        array[100] ^= 1
        sealed[2] = bytes(array)
    elif damage == "frames_swapped":
        sealed[0], sealed[1] = sealed[1], sealed[0]
    elif damage == "frame_dropped":
        del sealed[1]
    elif damage == "other_session":
        session_id, counter = proving.id, 10**6
    with caplog.at_level(logging.WARNING):
        raw_peer.send(_message(proving, session_id, counter, sealed, tagged=damage != "head_untagged"))
        assert raw_peer.closed_by_server()
    assert "event=bulk_refused" in caplog.text and "authentication tag" in caplog.text
    _still_serving(live, group, step=0)


def test_a_peer_without_a_session_key_gets_nothing_from_the_bulk_port(
        live: LiveShards, group: ShardGroup, caplog: pytest.LogCaptureFixture) -> None:
    session, address = _session_of(group)
    guessed = sessions.Session(id=os.urandom(sessions.ID_BYTES), key=os.urandom(sessions.KEY_BYTES))
    forged = sessions.Session(id=session.id, key=os.urandom(sessions.KEY_BYTES), sent=session.sent + 5)
    replayed = sessions.Session(id=session.id, key=session.key, sent=session.sent - 1)  # an old counter
    junk = {"an unknown session": guessed.hello() + _seal(guessed, _push_frames()),
            "does not start with the bulk channel's hello": b"".join(_push_frames()),
            "a hello that failed its authentication tag": forged.hello(),
            "replayed or reordered": replayed.hello()}
    with caplog.at_level(logging.WARNING):
        for reason, data in junk.items():
            peer = RawPeer(address)
            try:
                peer.send(data)
                assert peer.closed_by_server(), reason
            finally:
                peer.close()
            assert reason in caplog.text
    assert live.shards[0].metrics.rejected._value.get() == 0  # dropped before the shard's handling
    _still_serving(live, group, step=0)


def _flood(address: str, opening: bytes, total: int) -> int:
    """Write `opening`, then up to `total` bytes of 9 kB frames as fast as the shard takes
    them; the bytes written before it closed the connection."""
    peer, frame, written = RawPeer(address), b"f" * 9000, 0
    try:
        peer.send(opening)
        peer.socket.settimeout(5)
        while written < total:
            written += peer.socket.send(frame)
    except OSError:  # closed by the shard: reset, broken pipe, or no room for 5 s
        pass
    finally:
        peer.close()
    return written


def test_a_frame_flood_is_refused_before_it_is_buffered(live: LiveShards, group: ShardGroup,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """360 MB (40,000 frames of 9 kB, the size that once took a shard from 58 to 410 MiB)
    sent by a peer without a session, and by one with a session whose message announces
    40,000 frames or one frame over the cap: each connection is closed after its first
    bytes, and the shard's memory does not grow by the flood."""
    session, address = _session_of(group)
    openings = {"without a hello": b"\x00" * 9000,
                "40,000 frames": session.hello() + framing.HEAD.pack(session.id, session.sent + 2, 40_000),
                "a frame over the cap": (session.hello() + framing.HEAD.pack(session.id, session.sent + 2, 1)
                                          + struct.pack("<I", (1 << 32) - 1))}
    before = rss_bytes()
    with caplog.at_level(logging.WARNING):
        for name, opening in openings.items():
            written = _flood(address, opening, 40_000 * 9000)
            assert written < 100 * 1024 * 1024, f"{name}: {written} bytes taken before the connection was closed"
    grown = rss_bytes() - before
    assert grown < 32 * 1024 * 1024, f"RSS grew by {grown} bytes"
    assert "a message of 40000 frames" in caplog.text and "at most" in caplog.text
    group._links[0].reconnect()  # its session's counter is behind what the floods used
    _still_serving(live, group, step=0)


def test_replies_a_session_holder_never_reads_do_not_pile_up(tmp_path: Path, job_keys: keys.JobKeys) -> None:
    """60 sealed pulls of a 10 MB slice, none of their replies read: the shard keeps at most
    64 MiB of replies queued for the connection (600 MB without the bound), drops the rest,
    and goes on serving others."""
    layout = Layout.of([("w", (2_500_000,))], shards=1)
    live = start_shards(tmp_path, layout, np.zeros(layout.total, np.float32), security=job_keys.server_security(),
                        bulk_bind="tcp://127.0.0.1:*")
    group = live.group(security=job_keys.client_options())
    out = np.empty(layout.total, np.float32)
    greedy = None
    try:
        Float32Dense(group).pull(out)
        session, address = _session_of(group)
        greedy = _proven(RawPeer(address), session)
        greedy.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # it reads nothing
        before = rss_bytes()
        pull = Header(op=dense.PULL.code, shard=0, layout=layout.hash)
        for seq in range(60):
            greedy.send(_seal(session, [dataclasses.replace(pull, seq=seq).pack()]))
        pulls = live.shards[0].metrics.request_seconds("PULL")
        eventually(lambda: observed(pulls) >= 61, 60, what="every pull answered (or dropped)")
        grown = rss_bytes() - before
        assert grown < 150 * 1024 * 1024, f"RSS grew by {grown} bytes"
        other = live.group(security=job_keys.client_options())
        try:
            assert [r.step for r in Float32Dense(other).pull(out)] == [0]  # and others are still served
        finally:
            other.close()
    finally:
        if greedy is not None:
            greedy.close()
        group.close()
        live.stop()


def test_a_connection_that_never_proves_a_session_is_closed(live: LiveShards, group: ShardGroup,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from distbelief.runtime.transport import bulk_port
    monkeypatch.setattr(bulk_port, "HELLO_SECONDS", 0.5)
    _, address = _session_of(group)
    silent = RawPeer(address)
    try:
        silent.send(b"DB-BULK1")  # a hello begun, never finished
        time.sleep(1.0)
        RawPeer(address).close()  # a new connection makes the port look at its late ones
        assert silent.closed_by_server()
    finally:
        silent.close()
    _still_serving(live, group, step=0)


def test_requests_sent_while_the_grant_is_slow_reach_the_shard_in_their_order(
        live: LiveShards, job_keys: keys.JobKeys, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link holds its requests while its session is asked for: however long the grant
    takes, the shard takes them in the order they were sent, all over the session."""
    create = sessions.Table.create

    def slow_create(self: sessions.Table, *args, **kwargs) -> bytes:
        time.sleep(0.5)  # the link sends on while the grant is on its way
        return create(self, *args, **kwargs)
    monkeypatch.setattr(sessions.Table, "create", slow_create)
    transport = zmq_transport.ZmqTransport()
    link = transport.link(live.addresses[0], job_keys.client_options(), bulk=True)
    try:
        for seq in range(1, 9):
            assert link.send([Header(op=protocol.HELLO.code, shard=0, layout=LAYOUT.hash, seq=seq).pack()])
        seqs, deadline = [], time.monotonic() + 10
        while len(seqs) < 8 and time.monotonic() < deadline:
            ready = transport.wait([link], 0.5)
            if link.readable(ready) and (reply := link.receive()) is not None:
                seqs.append(protocol.unpack_header(reply.header).seq)
        assert seqs == list(range(1, 9))
        assert link.session is not None and link.session.sent == 1 + 8  # the hello, then every request
    finally:
        link.close()


def test_a_session_has_the_role_of_the_key_that_asked_for_it(live: LiveShards, job_keys: keys.JobKeys) -> None:
    replica, chief = _group(live, job_keys), _group(live, job_keys, keys.CHIEF)
    try:
        for group in (replica, chief):
            Float32Dense(group).pull(np.zeros(LAYOUT.total, np.float32))
            assert all(link.session is not None for link in group._links)
        with pytest.raises(errors.ShardRefused, match="chief's to send"):
            replica.done("forged", "succeeded")
        assert all(r.done for r in chief.done("finished", "succeeded"))
    finally:
        replica.close()
        chief.close()


def test_sessions_are_bounded_per_peer_and_in_total() -> None:
    table = sessions.Table(max_sessions=5, max_per_peer=2)
    grants = [sessions.parse_grant(table.create("replica", b"peer-a", port=1))[0] for _ in range(3)]
    assert len(table) == 2  # the peer's oldest went first
    with pytest.raises(errors.BulkRejected, match="unknown session"):
        table.find(grants[0].id)
    assert table.find(grants[2].id).key == grants[2].key
    for n in range(6):
        table.create("replica", f"peer-{n}".encode(), port=1)
    assert len(table) == 5
    assert sessions.parse_grant(sessions.NO_GRANT)[1] == 0 and sessions.parse_grant(b"DB" * 31) is None


def test_a_server_bounds_the_sessions_one_connection_asks_for(live: LiveShards, group: ShardGroup,
                                                              raw_peer: RawPeer,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    first, _ = _session_of(group)
    for _ in range(sessions.MAX_PER_PEER):
        group._links[0].reconnect()  # each fresh connection asks for a session anew
        Float32Dense(group).pull(np.zeros(LAYOUT.total, np.float32))
    newest, address = _session_of(group)
    with caplog.at_level(logging.WARNING):
        _proven(raw_peer, first)
        assert raw_peer.closed_by_server()
    assert "an unknown session" in caplog.text  # the oldest of the connection's sessions is gone
    fresh = _proven(RawPeer(address), newest)
    try:
        fresh.send(_seal(newest, _push_frames()))
        assert fresh.reply(5.0) is not None and live.shards[0].step == 1
    finally:
        fresh.close()


def test_a_link_asks_for_a_fresh_key_once_a_session_has_carried_its_share(
        live: LiveShards, job_keys: keys.JobKeys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions, "REKEY_BYTES", 3 * LAYOUT.bounds(0)[1] * 4)  # about 2 round trips
    group = _group(live, job_keys)
    try:
        out, ids, connections = np.zeros(LAYOUT.total, np.float32), set(), set()
        for step in range(6):
            Float32Dense(group).push_and_pull(np.zeros(LAYOUT.total, np.float32), out, steps=[step, step], examples=1,
                                              loss=0.0)
            ids.add(group._links[0].session.id if group._links[0].session else None)
            connections.add(group._links[0]._conn.bulk)
        assert len(ids - {None}) >= 2 and [s.step for s in live.shards] == [6, 6]
        assert len(connections) == 1  # every fresh key went over the same bulk connection
        np.testing.assert_array_equal(out, INITIAL)
    finally:
        group.close()


def test_a_bulk_port_in_use_is_one_clear_error(job_keys: keys.JobKeys) -> None:
    context = zmq.Context()  # its own ZAP handler, started and stopped here
    taken = context.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(errors.ConfigError, match=f"shard 0 cannot listen for bulk messages on .*:{port}"):
            zmq_transport.ZmqTransport(context).server("tcp://127.0.0.1:*", who="shard 0", max_frame=1024,
                                                   max_frames=3, security=job_keys.server_security(),
                                                   bulk=f"tcp://127.0.0.1:{port}")
    finally:
        taken.close(linger=0)
        context.term()
