"""Every socket of the runtime, client and server side, behind one small interface.

    Transport     makes Servers and Links; ZmqTransport (ZeroMQ over tcp:// or ipc://) for
                  the roles; memory_transport.MemoryTransport, an in-process twin for unit tests
    Server        a bound ROUTER: admission of the job's keys, message size and queue
                  bounds; receive() -> Incoming (the peer, its authenticated user, frames)
    Link          one DEALER to one shard, made anew after a silence or a disconnect (to
                  the shard's next copy in turn, when it has backups)
    exchange()    one request to several links at once, the replies collected under one
                  RetryPolicy (attempt timeout, resend on disconnect, give up); fanout.py,
                  re-exported here with the Server, Link and Transport interfaces

A shard's server and its replicas' links also speak a bulk channel when the job is
encrypted: AES-GCM sessions agreed over CurveZMQ, on a second socket pair without
CurveZMQ, so that parameters are not encrypted twice (sessions.py, docs/security.md).

Every socket counts the bytes it sends and receives in traffic.PROCESS_TRAFFIC (sealed
bulk frames as sealed: prefix and tags included).

ZeroMQ's errors are translated here into distbelief.runtime.errors and nowhere else;
no other module of the runtime imports zmq (admission.py registers the ZAP handler for it,
keys.py makes the keys).
Frames are memoryviews (or bytes) on both sides; parameter payloads are received
straight into the caller's array (Link.receive's sink), so a pull costs one copy.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from distbelief.runtime import admission, errors, keys, sessions
from distbelief.runtime.traffic import PROCESS_TRAFFIC
from distbelief.runtime.failover import Copies

log = logging.getLogger(__name__)

SEND_HWM = 64             # replies queued for one peer before further ones are dropped
# libzmq checks ZMQ_MAXMSGSIZE against a frame as it arrives, and CurveZMQ's box (flags,
# nonce, MAC: 33 bytes) arrives around every frame: a frame of exactly the allowed size
# must still get in.
FRAME_OVERHEAD = 64
RECEIVE_HWM = 256         # requests queued from one peer before it is pushed back
HEARTBEAT_MS = 1000       # a link to a shard's copies pings each; 3 missed pongs count as a disconnect
MAX_REPLY_FRAMES = 4


# -- ZeroMQ ------------------------------------------------------------------------------


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

    def poll(self, seconds: float) -> bool:
        """Whether a request is there to receive(), waiting up to `seconds`; session set-ups
        and refused bulk messages are dealt with here and not counted."""
        deadline = time.monotonic() + seconds
        while not self._ready:
            ready = dict(self._poller.poll(max(0.0, deadline - time.monotonic()) * 1000))
            if self._socket in ready:
                self._take_curve()
            if self._bulk is not None and self._bulk in ready:
                self._take_bulk()
            if not ready or time.monotonic() >= deadline:
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
                raise sessions.Refused("a message without frames, or with more than any op has")
            session = self._sessions.find(sealed[0])
            frames = sessions.open_all(session, sessions.TO_SERVER, sealed)
        except sessions.Refused as exc:
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


class ZmqLink:
    """One DEALER socket to one address (or to one of a shard's copies in turn). With watch,
    a monitor reports broken connections; it is read by broke(), or its queue fills and
    stalls the context's I/O thread.

    Every connection of a link carries one random routing id: the server names the peer by
    it (Incoming.peer), so a resend on a fresh connection is still the same peer's, and no
    other peer, key holder or not, can pass for it without guessing 128 bits. A link to a
    shard's copies keeps one connection to each (heartbeats notice a dead node) and moves
    between them: a second connection with the same id would take over the first, and
    ZeroMQ renames it, so its queued requests would count as another peer's.

    With `bulk` (a CurveZMQ link to one tcp:// address), the first request of each
    connection also asks for an AES-GCM session (sessions.py); once granted, requests and
    replies go sealed over a second DEALER to the server's bulk port. A reply there that
    fails its counter or a tag is refused (receive() gives None) and the request waits.
    A link to a shard's copies stays on CurveZMQ alone."""

    def __init__(self, context: zmq.Context, address: str | Sequence[str], options: dict | None, *,
                 watch: bool, bulk: bool = False) -> None:
        self.context, self.copies, self.options, self.watch = context, Copies(address), options, watch
        self.routing_id = os.urandom(16)
        self._idle: dict[str, tuple[zmq.Socket, zmq.Socket | None, bool]] = {}  # the other copies' connections
        self._bulk_wanted = (bulk and len(self.copies.addresses) == 1 and self.address.startswith("tcp://")
                             and zmq.CURVE_SERVERKEY in (options or {}))
        self._session: sessions.Session | None = None
        self._bulk: zmq.Socket | None = None
        self._socket, self._monitor = self._connect()

    @property
    def address(self) -> str:
        return self.copies.address

    def _connect(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        self._close_bulk()  # a fresh connection asks for a fresh session
        socket, monitor = self.context.socket(zmq.DEALER), None
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.ROUTING_ID, self.routing_id)
            for option, value in (self.options or {}).items():
                socket.setsockopt(option, value)
            if len(self.copies.addresses) > 1:
                socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
                socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * HEARTBEAT_MS)
            if self.watch:
                monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            socket.connect(self.address)
        except zmq.ZMQError as exc:
            if monitor is not None:
                monitor.close(linger=0)
            socket.close(linger=0)
            raise errors.ConfigError(f"cannot connect to {self.address}: {exc}") from exc
        self._handshaken = False
        return socket, monitor

    def pollables(self) -> list[zmq.Socket]:
        return [s for s in (self._socket, self._bulk, self._monitor) if s is not None]

    def readable(self, ready: dict) -> bool:
        return self._socket in ready or (self._bulk is not None and self._bulk in ready)

    def broke(self, ready: dict | None = None) -> bool:
        """Whether a connection that had completed its handshake broke since the last call
        (a refused handshake ends in a disconnect too; that one lost no request)."""
        if self._monitor is None or (ready is not None and self._monitor not in ready):
            return False
        broke = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshaken = True
            elif self._handshaken:
                self._handshaken, broke = False, True
        return broke

    def send(self, frames: Sequence[Frame]) -> bool:
        """Queue a request; False when the queue to the peer is full (the attempt's timeout
        sends it again)."""
        if self._session is not None and self._session.worn_out:
            self._close_bulk()  # and ask for a fresh key with this request
        if self._session is not None:
            return self._queue(self._bulk, self._session.seal(sessions.TO_SERVER, frames))
        if self._ask_session:  # the grant comes back ahead of this request's reply
            self._ask_session = not self._queue(self._socket, [sessions.SESSION_MAGIC])
        return self._queue(self._socket, frames)

    @staticmethod
    def _queue(socket: zmq.Socket, frames: Sequence[Frame]) -> bool:
        try:
            socket.send_multipart(list(frames), copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        PROCESS_TRAFFIC.sent(frames_nbytes(frames))
        return True

    def receive(self, sink: Sink | None = None) -> Received | None:
        """The next reply; None for a session grant, or a bulk reply that was refused."""
        try:
            if self._bulk is not None and self._bulk.poll(0):
                return self._receive_bulk(sink)
            return self._receive_curve(sink)
        except zmq.ZMQError as exc:
            raise errors.ProtocolError(f"reading a reply from {self.address} failed: {exc}") from exc

    def _receive_curve(self, sink: Sink | None) -> Received | None:
        header = self._socket.recv(copy=False).buffer
        if not self._socket.getsockopt(zmq.RCVMORE) and (grant := sessions.parse_grant(header)) is not None:
            self._take_grant(*grant)
            return None
        frames: list[memoryview] = []
        into_sink = dropped = 0
        index = 0
        while self._socket.getsockopt(zmq.RCVMORE):
            target = sink(header, index) if sink is not None and index < MAX_REPLY_FRAMES else None
            if target is not None:
                into_sink += self._socket.recv_into(target)
            elif index < MAX_REPLY_FRAMES:
                frames.append(self._socket.recv(copy=False).buffer)
            else:
                dropped += len(self._socket.recv(copy=False))  # beyond any op's reply: dropped
            index += 1
        received = Received(header=header, frames=frames, into_sink=into_sink)
        PROCESS_TRAFFIC.received(received.nbytes + dropped)
        return received

    def _take_grant(self, session: sessions.Session, port: int) -> None:
        if port == 0 or self._session is not None:
            return  # the server has no bulk channel (or this connection has its session)
        host = self.address.rsplit(":", 1)[0]
        bulk = self.context.socket(zmq.DEALER)
        bulk.setsockopt(zmq.LINGER, 0)
        bulk.connect(f"{host}:{port}")
        self._session, self._bulk = session, bulk

    def _receive_bulk(self, sink: Sink | None) -> Received | None:
        assert self._bulk is not None and self._session is not None
        prefix, *sealed = [f.buffer for f in self._bulk.recv_multipart(copy=False)]
        PROCESS_TRAFFIC.received(len(prefix) + sum(len(f) for f in sealed))
        try:
            if not 1 <= len(sealed) <= MAX_REPLY_FRAMES + 1:
                raise sessions.Refused("a reply without frames, or with more than any op has")
            return Received(*sessions.open_reply(self._session, prefix, sealed, sink))
        except sessions.Refused as exc:
            log.warning("event=bulk_refused peer=%r reason=%r", self.address, str(exc))
            return None

    def reconnect(self) -> None:
        """A fresh socket: replies to earlier requests and copies still queued are dropped. A link
        to copies moves to the next copy's connection instead."""
        if len(self.copies.addresses) == 1:
            self.close()
            self._socket, self._monitor = self._connect()
            return
        self._idle[self.address] = (self._socket, self._monitor, self._handshaken)
        self.copies.next()
        idle = self._idle.pop(self.address, None)
        self._socket, self._monitor, self._handshaken = idle or (*self._connect(), False)

    def _close_bulk(self) -> None:
        if self._bulk is not None:
            self._bulk.close(linger=0)
        self._session, self._bulk, self._ask_session = None, None, self._bulk_wanted

    def close(self) -> None:
        self._close_bulk()
        for socket, monitor, _ in [(self._socket, self._monitor, False), *self._idle.values()]:
            if socket.closed:
                continue
            if monitor is not None:
                socket.disable_monitor()
                monitor.close(linger=0)
            socket.close(linger=0)
        self._idle.clear()


class ZmqTransport:
    """ZeroMQ over tcp:// (or ipc://), one context per process by default."""

    def __init__(self, context: zmq.Context | None = None) -> None:
        self.context = context or zmq.Context.instance()

    def server(self, address: str, *, who: str, max_frame: int, max_frames: int,
               security: keys.ServerSecurity | None, bulk: str | None = None) -> ZmqServer:
        return ZmqServer(self.context, address, who=who, max_frame=max_frame, max_frames=max_frames,
                         security=security, bulk=bulk)

    def link(self, address: str | Sequence[str], options: dict | None, *, watch: bool = True,
             bulk: bool = False) -> ZmqLink:
        return ZmqLink(self.context, address, options, watch=watch, bulk=bulk)

    def wait(self, links: Sequence[ZmqLink], seconds: float) -> dict:
        poller = zmq.Poller()
        for link in links:
            for pollable in link.pollables():
                poller.register(pollable, zmq.POLLIN)
        return dict(poller.poll(seconds * 1000))


def default() -> ZmqTransport:
    return ZmqTransport()


# Re-exported: callers use transport.exchange, transport.Link and the rest.
from distbelief.runtime.fanout import (  # noqa: E402
    REDIRECT, STOP_POLL_SECONDS, Exchange, Frame, Incoming, Link, Received, RetryPolicy, Server, Sink, Transport,
    exchange, frames_nbytes)
