"""The serving side of the ZeroMQ transport: a ROUTER bound to an address.

It admits the job's keys (admission.py: CurveZMQ or PLAIN through ZAP), bounds message
sizes and queues, names each peer by its connection's routing id, and, for encrypted
jobs, takes the AES-GCM sessions' messages on a second ROUTER without CurveZMQ
(sessions.py, docs/security.md). ZeroMQ's errors become distbelief.runtime.errors here.
Every frame's bytes count in traffic.PROCESS_TRAFFIC.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Sequence

import zmq

from distbelief.runtime import errors, keys
from distbelief.runtime.observe.traffic import PROCESS_TRAFFIC
from distbelief.runtime.transport import admission, sessions
from distbelief.runtime.transport.interface import STOP_POLL_SECONDS, Frame, Incoming, Link, frames_nbytes

log = logging.getLogger(__name__)

SEND_HWM = 64             # replies queued for one peer before further ones are dropped
# libzmq checks ZMQ_MAXMSGSIZE against a frame as it arrives, and CurveZMQ's box (flags,
# nonce, MAC: 33 bytes) arrives around every frame: a frame of exactly the allowed size
# must still get in.
FRAME_OVERHEAD = 64
RECEIVE_HWM = 256         # requests queued from one peer before it is pushed back


def _router(context: zmq.Context, max_frame: int) -> zmq.Socket:
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.MAXMSGSIZE, max_frame + FRAME_OVERHEAD)
    socket.setsockopt(zmq.SNDHWM, SEND_HWM)
    socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
    socket.setsockopt(zmq.LINGER, 1000)
    return socket


def _send(socket: zmq.Socket, peer: bytes, frames: Sequence[Frame], who: str) -> bool:
    """Queue a message to peer; False when its queue is full (it does not read its replies)."""
    try:
        socket.send_multipart([peer, *frames], copy=False, flags=zmq.NOBLOCK)
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:
        log.warning("event=reply_failed server=%r error=%r", who, str(exc))
        return False
    PROCESS_TRAFFIC.sent(frames_nbytes(frames))
    return True


class ZmqServer:
    """A ROUTER admitting the job's keys. With `bulk` (an address) and CurveZMQ, a second
    ROUTER without CurveZMQ takes the messages of the AES-GCM sessions (sessions.py) that
    peers asked for over the first: a message there that is not of a known session, or
    fails its counter or a tag, is dropped (logged at a bounded rate) and never received.
    The replies to a peer go the way its last request came."""

    def __init__(self, context: zmq.Context, address: str, *, who: str, max_frame: int, max_frames: int,
                 security: keys.ServerSecurity | None, bulk: str | None = None) -> None:
        self.who, self.max_frames = who, max_frames
        socket = _router(context, max_frame)
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._domain = f"distbelief-{who.replace(' ', '-')}-{id(self):x}"
        self._admission = admission.bind_server(context, socket, address, who=who, domain=self._domain,
                                                security=security)
        self._socket, self._bulk, self._bulk_admission = socket, None, None
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(socket, zmq.POLLIN)
        self._sessions, self._refusals = sessions.Table(), sessions.RefusalLog(who)
        if bulk is not None and security is not None and security.mechanism == "curve":
            self._bulk = self._bind_bulk(context, bulk, max_frame)
        self._ready: collections.deque[Incoming | None] = collections.deque()

    def _bind_bulk(self, context: zmq.Context, address: str, max_frame: int) -> zmq.Socket:
        """The bulk ROUTER. It has no CurveZMQ, so the ZAP handler admits a connection to it
        only from an address that holds a session: anyone else cannot make the shard buffer
        a message (libzmq assembles a whole message, however many frames, before we see it)."""
        bulk = _router(context, max_frame)
        domain = f"{self._domain}-bulk"
        try:
            self._bulk_admission = admission.admit_addresses(context, domain, self._sessions.holds)
            bulk.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
            bulk.bind(address)
        except zmq.ZMQError as exc:
            bulk.close(linger=0)
            self.close()
            raise errors.ConfigError(f"{self.who} cannot listen for bulk messages on {address}: {exc}") from exc
        self._poller.register(bulk, zmq.POLLIN)
        self.bulk_endpoint = bulk.getsockopt_string(zmq.LAST_ENDPOINT)
        return bulk

    def poll(self, seconds: float, links: Sequence[Link] = ()) -> bool:
        """Whether a request is there to receive(), waiting up to `seconds` or until one of
        `links` is readable; session set-ups and refused bulk messages are dealt with here
        and not counted."""
        deadline = time.monotonic() + seconds
        poller = self._poller
        if links:
            poller = zmq.Poller()
            extra = [s for link in links for s in link.pollables()]  # type: ignore[attr-defined]  # ZmqLinks
            for socket in [self._socket, self._bulk, *extra]:
                if socket is not None:
                    poller.register(socket, zmq.POLLIN)
        while not self._ready:
            ready = dict(poller.poll(max(0.0, deadline - time.monotonic()) * 1000))
            if self._socket in ready:
                self._take_curve()
            if self._bulk is not None and self._bulk in ready:
                self._take_bulk()
            if not ready or time.monotonic() >= deadline or len(ready) > (self._socket in ready) + (
                    self._bulk is not None and self._bulk in ready):
                break
        return bool(self._ready)

    def receive(self) -> Incoming | None:
        """The next request, or None when it must be dropped (more frames than any op has)."""
        while not self._ready:
            self.poll(STOP_POLL_SECONDS)
        return self._ready.popleft()

    def _take_curve(self) -> None:
        frames = self._socket.recv_multipart(copy=False)
        PROCESS_TRAFFIC.received(sum(len(f) for f in frames[1:]))
        if len(frames) - 1 > self.max_frames:
            self._ready.append(None)
            return
        peer, body = frames[0].bytes, [f.buffer for f in frames[1:]]
        user = frames[-1].get("User-Id") if self._admission is not None else None
        if len(body) == 1 and body[0] == sessions.SESSION_MAGIC:
            _send(self._socket, peer, [self._grant(user, peer, frames[-1].get("Peer-Address"))], self.who)
            return
        self._sessions.unroute(peer)  # it speaks over CurveZMQ again: so do the replies
        self._ready.append(Incoming(peer=peer, user=user, frames=body))

    def _grant(self, user: str | None, peer: bytes, address: str) -> bytes:
        if self._bulk is None:
            return sessions.NO_GRANT
        return self._sessions.create(user, peer, port=int(self.bulk_endpoint.rsplit(":", 1)[1]), address=address)

    def _take_bulk(self) -> None:
        route, *sealed = [f.buffer for f in self._bulk.recv_multipart(copy=False)]
        PROCESS_TRAFFIC.received(sum(len(f) for f in sealed))
        try:
            if not 2 <= len(sealed) <= self.max_frames + 1:
                raise errors.BulkRejected("a message without frames, or with more than any op has")
            session = self._sessions.find(sealed[0])
            frames = sessions.open_all(session, sessions.TO_SERVER, sealed)
        except errors.BulkRejected as exc:
            self._refusals.refused(str(exc))
            return
        self._sessions.route(session, bytes(route))
        self._ready.append(Incoming(peer=session.peer, user=session.user, frames=[memoryview(f) for f in frames]))

    def send(self, peer: bytes, frames: Sequence[Frame]) -> bool:
        """Queue a reply; False when the peer's queue is full (it does not read its replies)."""
        session = self._sessions.routed(peer)
        if session is None:
            return _send(self._socket, peer, frames, self.who)
        return _send(self._bulk, session.route, session.seal(sessions.TO_CLIENT, frames), self.who)

    def close(self) -> None:
        self._socket.close()
        if self._bulk is not None:
            self._bulk.close()
        for held in (self._admission, self._bulk_admission):
            if held is not None:
                held.close()
        self._admission = self._bulk_admission = None

