"""The bulk channel of encrypted jobs (distbelief.runtime.transport.sessions): AES-256-GCM sessions
agreed over CurveZMQ, on a socket without CurveZMQ. Live shards on loopback; the attacker
sends raw ZeroMQ messages to the bulk port, with or without a session's key."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from distbelief.runtime import errors, keys
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.params import dense
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.transport import sessions, zmq_transport
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.protocol import Header

from support.shards import LiveShards, start_shards

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


def test_pulls_and_pushes_over_sessions_match_curvezmq_alone(tmp_path: Path, job_keys: keys.JobKeys) -> None:
    results = {}
    for bulk in (True, False):
        live = _start(tmp_path / str(bulk), job_keys, bulk=bulk)
        group = _group(live, job_keys)
        try:
            results[bulk] = _train(group)
            assert all((link.session is not None) is bulk for link in group._links)
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


class RawPeer:
    """A DEALER on the bulk port with no CurveZMQ: sends whatever it is given."""

    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def send(self, frames: list[bytes]) -> None:
        self.socket.send_multipart(frames)

    def reply(self, seconds: float) -> list[bytes] | None:
        return self.socket.recv_multipart() if self.socket.poll(int(seconds * 1000)) else None

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


def test_a_sealed_push_is_applied_once_and_its_replay_is_refused(live: LiveShards, group: ShardGroup,
                                                                  raw_peer: RawPeer,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    session, _ = _session_of(group)
    sealed = session.seal(sessions.TO_SERVER, _push_frames(seq=1))  # before the group's next command
    raw_peer.send(sealed)
    assert raw_peer.reply(5.0) is not None  # whoever holds the session key is answered...
    assert live.shards[0].step == 1
    before = live.params(0).copy()
    with caplog.at_level(logging.WARNING):
        raw_peer.send(sealed)  # ...and a copy of its message, sent again, is refused
        assert raw_peer.reply(0.5) is None
    assert "replayed or reordered" in caplog.text
    np.testing.assert_array_equal(live.params(0), before)
    group._links[0].reconnect()  # its counter is behind the copy's: a fresh connection, a new session
    _still_serving(live, group, step=1)


@pytest.mark.parametrize("damage", ["flipped_bit", "frames_swapped", "frame_dropped", "other_session"])
def test_a_forged_or_altered_bulk_message_is_refused(live: LiveShards, job_keys: keys.JobKeys, group: ShardGroup,
                                                      raw_peer: RawPeer, damage: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    session, _ = _session_of(group)
    sealed = session.seal(sessions.TO_SERVER, _push_frames())
    if damage == "flipped_bit":
        array = bytearray(sealed[3])
        array[100] ^= 1
        sealed[3] = bytes(array)
    elif damage == "frames_swapped":
        sealed[1], sealed[2] = sealed[2], sealed[1]
    elif damage == "frame_dropped":
        del sealed[2]
    else:  # a message sealed under one session, sent under another's id
        other = _group(live, job_keys)
        Float32Dense(other).pull(np.zeros(LAYOUT.total, np.float32))
        sealed[0] = sessions.PREFIX.pack(_session_of(other)[0].id, 10**6)
        other.close()
    with caplog.at_level(logging.WARNING):
        raw_peer.send(sealed)
        assert raw_peer.reply(0.5) is None
    assert "event=bulk_refused" in caplog.text and "authentication tag" in caplog.text
    _still_serving(live, group, step=0)


def test_a_peer_without_a_curvezmq_handshake_gets_nothing_from_the_bulk_port(
        live: LiveShards, group: ShardGroup, raw_peer: RawPeer, caplog: pytest.LogCaptureFixture) -> None:
    guessed = sessions.Session(id=os.urandom(sessions.ID_BYTES), key=os.urandom(sessions.KEY_BYTES))
    junk = [guessed.seal(sessions.TO_SERVER, _push_frames()),  # a session it made up
            _push_frames(),                                  # the protocol's frames, unsealed
            [b"x" * sessions.PREFIX.size],                   # a prefix alone
            [b"short", b"y"],                                # no prefix
            [b"z"] * 40]                                     # more frames than any op has
    with caplog.at_level(logging.WARNING):
        for frames in junk:
            raw_peer.send(frames)
        assert raw_peer.reply(1.0) is None
    assert "an unknown session" in caplog.text
    assert live.shards[0].metrics.rejected._value.get() == 0  # dropped before the shard's handling
    _still_serving(live, group, step=0)


def _refused_at_handshake(bulk_endpoint: str, source: str) -> bool:
    """Whether a DEALER connecting from `source` (an address on loopback) to the bulk port
    is refused by the ZAP handler, before any message of it reaches the shard."""
    port = bulk_endpoint.rsplit(":", 1)[1]
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        socket.connect(f"tcp://{source}:0;127.0.0.1:{port}")
        for _ in range(5):  # a frame flood: many frames under the cap, in one message
            try:
                socket.send_multipart([b"f" * 60_000] * 100, flags=zmq.NOBLOCK)
            except zmq.Again:  # queued up to the high-water mark: enough
                break
        if not monitor.poll(5000):
            raise AssertionError("the handshake neither failed nor succeeded within 5 s")
        return recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    finally:
        socket.disable_monitor()
        monitor.close()
        socket.close()


def test_the_bulk_port_admits_only_addresses_that_hold_a_session(
        live: LiveShards, job_keys: keys.JobKeys, caplog: pytest.LogCaptureFixture) -> None:
    replica = _group(live, job_keys)
    with caplog.at_level(logging.WARNING):
        try:
            Float32Dense(replica).pull(np.zeros(LAYOUT.total, np.float32))  # its links' sessions: from 127.0.0.1
            bulk_endpoint = _session_of(replica)[1]
            assert _refused_at_handshake(bulk_endpoint, "127.0.0.2")  # another host, without a session
            assert not _refused_at_handshake(bulk_endpoint, "127.0.0.1")
            _still_serving(live, replica, step=0)
        finally:
            replica.close()
    assert "reason=no_session_from_address" in caplog.text
    assert "an unknown session" not in caplog.text  # no refused message ever reached the shard


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
        table.find(sessions.PREFIX.pack(grants[0].id, 1))
    assert table.find(sessions.PREFIX.pack(grants[2].id, 1)).key == grants[2].key
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
    newest, _ = _session_of(group)
    with caplog.at_level(logging.WARNING):
        raw_peer.send(first.seal(sessions.TO_SERVER, _push_frames()))
        assert raw_peer.reply(0.5) is None
    assert "an unknown session" in caplog.text  # the oldest of the connection's sessions is gone
    raw_peer.send(newest.seal(sessions.TO_SERVER, _push_frames()))
    assert raw_peer.reply(5.0) is not None and live.shards[0].step == 1


def test_a_link_asks_for_a_fresh_key_once_a_session_has_carried_its_share(
        live: LiveShards, job_keys: keys.JobKeys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions, "REKEY_BYTES", 3 * LAYOUT.bounds(0)[1] * 4)  # about 2 round trips
    group = _group(live, job_keys)
    try:
        out, ids = np.zeros(LAYOUT.total, np.float32), set()
        for step in range(6):
            Float32Dense(group).push_and_pull(np.zeros(LAYOUT.total, np.float32), out, steps=[step, step], examples=1,
                                              loss=0.0)
            ids.add(group._links[0].session.id if group._links[0].session else None)
        assert len(ids - {None}) >= 2 and [s.step for s in live.shards] == [6, 6]
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
