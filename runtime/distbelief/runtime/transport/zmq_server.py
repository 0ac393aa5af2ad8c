"""The serving side of the ZeroMQ transport: a ROUTER bound to an address.

It admits the job's keys (admission.py: CurveZMQ or PLAIN through ZAP), bounds message
sizes and queues, names each peer by its connection's routing id, and, for encrypted
jobs, takes the AES-GCM sessions' messages on a TCP port of our own framing
(bulk_port.py, sessions.py, docs/security.md). ZeroMQ's errors become distbelief.runtime.errors here.
Every frame's bytes count in traffic.PROCESS_TRAFFIC.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Sequence, cast

import zmq

from distbelief.runtime import errors, keys
from distbelief.runtime.observe.traffic import PROCESS_TRAFFIC
from distbelief.runtime.transport import admission, bulk_port, framing, sessions
from distbelief.runtime.transport.interface import STOP_POLL_SECONDS, Frame, Incoming, Link, frames_nbytes

log = logging.getLogger(__name__)

# Replies queued for one peer before further ones are dropped. libzmq hears of the peer's
# reads in steps of half of it, so a burst of more than about 32 unread replies may lose
# some; a client (client/group.py) has one request in flight per shard, and a resend gets
# the reply again.
SEND_HWM = 64
# libzmq checks ZMQ_MAXMSGSIZE against a frame as it arrives, and CurveZMQ's box (flags,
# nonce, MAC: 33 bytes) arrives around every frame: a frame of exactly the allowed size
# must still get in.
FRAME_OVERHEAD = 64
RECEIVE_HWM = 256         # requests queued from one peer before it is pushed back
# A connection that has not completed its handshake (the greeting, then CurveZMQ or PLAIN
# and ZAP) this soon is dropped: a peer that opens TCP connections and says nothing holds
# each no longer (libzmq's default is 30 s; a handshake takes milliseconds).
HANDSHAKE_MS = 10_000


def _router(context: zmq.Context, max_frame: int) -> zmq.Socket:
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
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
    """A ROUTER admitting the job's keys. With `bulk` (an address) and CurveZMQ, a TCP port
    of our own framing (bulk_port.py) takes the messages of the AES-GCM sessions
    (sessions.py) that peers asked for over the ROUTER: a connection there that does not
    prove a session, or a message that fails its counter or a tag, is closed (logged at a
    bounded rate) and never received. The replies to a peer go the way its last request came."""

    def __init__(self, context: zmq.Context, address: str, *, who: str, max_frame: int, max_frames: int,
                 security: keys.ServerSecurity | None, bulk: str | None = None) -> None:
        self.who, self.max_frames = who, max_frames
        socket = _router(context, max_frame)
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._domain = f"distbelief-{who.replace(' ', '-')}-{id(self):x}"
        self._admission = admission.bind_server(context, socket, address, who=who, domain=self._domain,
                                                security=security)
        self._socket, self._bulk = socket, None
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sessions = sessions.Table()
        if bulk is not None and security is not None and security.mechanism == "curve":
            self._bulk = self._bind_bulk(bulk, max_frame)
        self._ready: collections.deque[Incoming | None] = collections.deque()

    def _bind_bulk(self, address: str, max_frame: int) -> bulk_port.BulkPort:
        limits = framing.Limits(max_frames=self.max_frames, max_frame=max_frame + sessions.TAG_BYTES)
        try:
            port = bulk_port.BulkPort(address, who=self.who, limits=limits, table=self._sessions)
        except (OSError, errors.ConfigError) as exc:
            self.close()
            raise errors.ConfigError(f"{self.who} cannot listen for bulk messages on {address}: {exc}") from exc
        self.bulk_endpoint = port.endpoint
        return port

    def _poller(self, links: Sequence[Link]) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        for fd, reads, writes in self._bulk.watched() if self._bulk is not None else ():
            if reads or writes:
                poller.register(fd, (zmq.POLLIN if reads else 0) | (zmq.POLLOUT if writes else 0))
        for link in links:
            for pollable, flags in link.pollables():  # type: ignore[attr-defined]  # ZmqLinks
                poller.register(pollable, flags)
        return poller

    def poll(self, seconds: float, links: Sequence[Link] = ()) -> bool:
        """Whether a request is there to receive(), waiting up to `seconds` or until one of
        `links` has something to read; session set-ups, bulk connections and refused bulk
        messages are dealt with here and not counted."""
        deadline = time.monotonic() + seconds
        while not self._ready:
            waiting = any(link.pending() for link in links)  # type: ignore[attr-defined]
            ready = dict(self._poller(links).poll(0 if waiting else int(max(0.0, deadline - time.monotonic()) * 1000)))
            if self._socket in ready:
                self._take_curve()
            if self._bulk is not None:
                self._ready.extend(self._bulk.serve(ready))
            woken = [link.pump(ready) for link in links]  # type: ignore[attr-defined]  # ZmqLinks
            if any(woken) or not ready or time.monotonic() >= deadline:
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
        user = cast("str | None", frames[-1].get("User-Id")) if self._admission is not None else None  # ZAP's user id
        if len(body) == 1 and body[0] == sessions.SESSION_MAGIC:
            _send(self._socket, peer, [self._grant(user, peer)], self.who)
            return
        self._sessions.unroute(peer)  # it speaks over CurveZMQ again: so do the replies
        self._ready.append(Incoming(peer=peer, user=user, frames=body))

    def _grant(self, user: str | None, peer: bytes) -> bytes:
        if self._bulk is None:
            return sessions.NO_GRANT
        return self._sessions.create(user, peer, port=self._bulk.port)

    def send(self, peer: bytes, frames: Sequence[Frame]) -> bool:
        """Queue a reply; False when the peer's queue is full (it does not read its replies)."""
        session = self._sessions.routed(peer)
        if session is None or self._bulk is None:
            return _send(self._socket, peer, frames, self.who)
        return self._bulk.send(session, frames)

    def close(self) -> None:
        self._socket.close()
        if self._bulk is not None:
            self._bulk.close()
        if self._admission is not None:
            self._admission.close()
        self._admission = None
