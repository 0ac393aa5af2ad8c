"""The client side of the ZeroMQ transport: a DEALER to one peer, or to a shard's copies
in turn (copy_addresses.py).

A link is made anew after a silence or a disconnect; a monitor reports broken
connections. For encrypted jobs the first request of each connection asks for an AES-GCM
session, and parameters then go sealed over a second DEALER to the server's bulk port
(sessions.py). Replies' array frames are received straight into the caller's array (the
sink), so a pull costs one copy. ZeroMQ's errors become distbelief.runtime.errors here.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from distbelief.runtime import errors
from distbelief.runtime.observe.traffic import PROCESS_TRAFFIC
from distbelief.runtime.transport import sessions
from distbelief.runtime.transport.copy_addresses import CopyAddresses
from distbelief.runtime.transport.interface import MAX_REPLY_FRAMES, Frame, Received, Sink, frames_nbytes

log = logging.getLogger(__name__)

HEARTBEAT_MS = 1000       # a link to a shard's copies pings each; 3 missed pongs count as a disconnect


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
                 watch: bool, bulk: bool = False, heartbeat: float | None = None) -> None:
        self.context, self.copies, self.options, self.watch = context, CopyAddresses(address), options, watch
        self.heartbeat_ms = int(heartbeat * 1000) if heartbeat else (HEARTBEAT_MS if len(self.copies.addresses) > 1
                                                                      else 0)
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
            if self.heartbeat_ms:
                socket.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ms)
                socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self.heartbeat_ms)
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
                raise errors.BulkRejected("a reply without frames, or with more than any op has")
            return Received(*sessions.open_reply(self._session, prefix, sealed, sink))
        except errors.BulkRejected as exc:
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

