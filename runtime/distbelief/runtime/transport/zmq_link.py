"""The client side of the ZeroMQ transport: a DEALER to one peer, or to a shard's copies
in turn (copy_addresses.py).

A link is made anew after a silence or a disconnect; a monitor reports broken
connections. For encrypted jobs each connection first asks for an AES-GCM session, and
requests and replies then go sealed over a TCP connection of our own framing to the
server's bulk port (sessions.py, framing.py). A CurveZMQ reply's array frames are received
straight into the caller's array (the sink); a bulk reply is read into a buffer the link
reuses and opened from there into the sink. ZeroMQ's errors become
distbelief.runtime.errors here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from distbelief.runtime import errors
from distbelief.runtime.observe.traffic import PROCESS_TRAFFIC
from distbelief.runtime.transport import framing, sessions
from distbelief.runtime.transport.copy_addresses import CopyAddresses
from distbelief.runtime.transport.interface import MAX_REPLY_FRAMES, Frame, Received, Sink, frames_nbytes

log = logging.getLogger(__name__)

HEARTBEAT_MS = 1000       # a link to a shard's copies pings each; 3 missed pongs count as a disconnect
MAX_HELD = 1000           # requests held while a session is asked for: ZeroMQ's own send queue
MAX_QUEUED = 1000         # sealed requests waiting for the bulk connection to take them
# A reply's frames: a header and MAX_REPLY_FRAMES more; a frame of up to 4 GiB (its u32 length)
REPLY_LIMITS = framing.Limits(max_frames=MAX_REPLY_FRAMES + 1, max_frame=(1 << 32) - 1)


@dataclasses.dataclass(eq=False)
class Connection:
    """A link's connection to one address: its CurveZMQ DEALER and monitor, and, when it
    wants one, its AES-GCM session and the connection to the server's bulk port.

    While a SESSION request is out (`asking`), requests are held, copied, and go out when the
    grant comes: so the server takes them in the order they were sent, never some over
    CurveZMQ and later ones ahead of them over the bulk connection. A fresh key keeps the
    bulk connection; replies sealed under the key before (`earlier`) are still opened."""

    address: str
    socket: zmq.Socket
    monitor: zmq.Socket | None
    bulk_wanted: bool
    handshaken: bool = False
    asking: bool = False
    held: list[list[Frame]] = dataclasses.field(default_factory=list)
    session: sessions.Session | None = None
    earlier: sessions.Session | None = None
    bulk: framing.Stream | None = None
    bulk_endpoint: str | None = None  # the bulk port's TCP address (its Unix socket may carry the bytes)

    def needs_session(self) -> bool:
        return self.bulk_wanted and not self.asking and (self.session is None or self.session.worn_out)

    def session_of(self, prefix: Frame) -> sessions.Session | None:
        """The session a bulk reply is sealed under, by the id its prefix names."""
        earlier = self.earlier
        if earlier is not None and bytes(prefix[:sessions.ID_BYTES]) == earlier.id:
            return earlier
        return self.session

    def check_head(self, _: framing.Stream, head: bytes, tag: bytes) -> None:
        """A reply's head is one of this connection's sessions, fresh, with its tag (framing.HeadCheck)."""
        session = self.session_of(head)
        if session is None:
            raise errors.BulkRejected("a reply of no session of this link")
        session.check_head(sessions.TO_CLIENT, head, tag)

    def forget_session(self) -> None:
        """Its session, bulk connection and held requests dropped: the next request asks anew."""
        if self.bulk is not None:
            self.bulk.close()
        self.bulk = self.session = self.earlier = None
        self.asking = False
        self.held.clear()

    def close(self) -> None:
        self.forget_session()
        if self.socket.closed:
            return
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
        self.socket.close(linger=0)


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

    With `bulk` (CurveZMQ links to tcp:// addresses), each connection asks for an AES-GCM
    session (sessions.py) before its first request; once granted, requests and replies go
    sealed over a TCP connection to that server's bulk port (framing.py), which opens with
    the session's hello. A reply there that fails its counter or a tag is refused (receive()
    gives None), the connection closed, and the request waits for its resend.

    The bulk connection does not block: what it cannot write at once waits, and is written
    (and replies read) by pump(), which ZmqTransport.wait and ZmqServer.poll call."""

    def __init__(self, context: zmq.Context, address: str | Sequence[str], options: dict | None, *,
                 watch: bool, bulk: bool = False, heartbeat: float | None = None) -> None:
        self.context, self.copies, self.options, self.watch = context, CopyAddresses(address), options, watch
        self.heartbeat_ms = int(heartbeat * 1000) if heartbeat else (HEARTBEAT_MS if len(self.copies.addresses) > 1
                                                                      else 0)
        self.routing_id = os.urandom(16)
        self._wants_bulk = bulk and zmq.CURVE_SERVERKEY in (options or {})
        self._idle: dict[str, Connection] = {}  # the other copies' connections
        self._pool = framing.BufferPool(keep=1)  # a reply's buffer, reused
        self._conn = self._connect()

    @property
    def address(self) -> str:
        return self.copies.address

    @property
    def session(self) -> sessions.Session | None:
        """The AES-GCM session of the connection in use, once granted."""
        return self._conn.session

    @property
    def bulk_endpoint(self) -> str | None:
        """Where the connection in use sends its sealed requests, once a session is granted."""
        conn = self._conn
        return conn.bulk_endpoint if conn.bulk is not None and not conn.bulk.closed else None

    @property
    def bulk_family(self) -> int | None:
        """The socket family of the bulk connection in use: AF_UNIX to a shard on this machine."""
        bulk = self._conn.bulk
        return bulk.sock.family if bulk is not None and not bulk.closed else None

    def _connect(self) -> Connection:
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
        return Connection(address=self.address, socket=socket, monitor=monitor,
                          bulk_wanted=self._wants_bulk and self.address.startswith("tcp://"))

    def pollables(self) -> list[tuple[object, int]]:
        """What to poll, and for what: the bulk connection for writing too while it has queued bytes."""
        conn = self._conn
        polled: list[tuple[object, int]] = [(conn.socket, zmq.POLLIN)]
        if conn.monitor is not None:
            polled.append((conn.monitor, zmq.POLLIN))
        if conn.bulk is not None and not conn.bulk.closed:
            polled.append((conn.bulk.fd, zmq.POLLIN | (zmq.POLLOUT if conn.bulk.queued else 0)))
        return polled

    def pending(self) -> bool:
        """Whether a whole bulk reply waits to be received (a poll need not wait)."""
        bulk = self._conn.bulk
        return bulk is not None and bulk.message is not None

    def pump(self, ready: dict) -> bool:
        """Write the bulk connection's queued bytes and read its reply, if the poll found it
        ready; whether the caller has something to look at (readable, or a monitor event)."""
        conn = self._conn
        if conn.bulk is not None and conn.bulk.ready_in(ready):
            try:
                PROCESS_TRAFFIC.received(conn.bulk.pump())
            except errors.BulkRejected as exc:
                log.warning("event=bulk_refused peer=%r reason=%r", self.address, str(exc))
                conn.bulk.close()
            if conn.bulk.closed:
                log.info("event=bulk_connection_closed peer=%r", self.address)
                conn.forget_session()
        return self.readable(ready) or (conn.monitor is not None and conn.monitor in ready)

    def readable(self, ready: dict) -> bool:
        return self._conn.socket in ready or self.pending()

    def broke(self, ready: dict | None = None) -> bool:
        """Whether a connection that had completed its handshake broke since the last call
        (a refused handshake ends in a disconnect too; that one lost no request). A broken
        connection's session is forgotten: ZeroMQ may reconnect it to a restarted peer."""
        conn = self._conn
        if conn.monitor is None or (ready is not None and conn.monitor not in ready):
            return False
        broke = False
        while conn.monitor.poll(0):
            event = recv_monitor_message(conn.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                conn.handshaken = True
            elif conn.handshaken:
                conn.handshaken, broke = False, True
        if broke:
            conn.forget_session()
        return broke

    def send(self, frames: Sequence[Frame]) -> bool:
        """Queue a request; False when the queue to the peer is full (the attempt's timeout
        sends it again)."""
        conn = self._conn
        if conn.needs_session():
            if not self._queue(conn.socket, [sessions.SESSION_MAGIC]):
                return False
            conn.asking = True
        if conn.asking:
            if len(conn.held) >= MAX_HELD:
                return False
            conn.held.append([bytes(f) for f in frames])  # the caller may reuse its buffers once this returns
            return True
        return self._send_now(conn, frames)

    def _send_now(self, conn: Connection, frames: Sequence[Frame]) -> bool:
        if conn.session is None or conn.bulk is None:
            return self._queue(conn.socket, frames)
        if conn.bulk.closed or conn.bulk.queued >= MAX_QUEUED:
            return False
        data, buffer = conn.session.seal_into(sessions.TO_SERVER, frames, self._pool)
        conn.bulk.send(data, buffer)
        PROCESS_TRAFFIC.sent(len(data))
        return True

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
        conn = self._conn
        try:
            if self.pending():
                return self._receive_bulk(conn, sink)
            return self._receive_curve(conn, sink)
        except zmq.ZMQError as exc:
            raise errors.ProtocolError(f"reading a reply from {self.address} failed: {exc}") from exc

    def _receive_curve(self, conn: Connection, sink: Sink | None) -> Received | None:
        socket = conn.socket
        header = socket.recv(copy=False).buffer
        if not socket.getsockopt(zmq.RCVMORE) and (grant := sessions.parse_grant(header)) is not None:
            self._take_grant(conn, *grant)
            return None
        frames: list[memoryview] = []
        into_sink = dropped = 0
        index = 0
        while socket.getsockopt(zmq.RCVMORE):
            target = sink(header, index) if sink is not None and index < MAX_REPLY_FRAMES else None
            if target is not None:
                into_sink += socket.recv_into(target)
            elif index < MAX_REPLY_FRAMES:
                frames.append(socket.recv(copy=False).buffer)
            else:
                dropped += len(socket.recv(copy=False))  # beyond any op's reply: dropped
            index += 1
        received = Received(header=header, frames=frames, into_sink=into_sink)
        PROCESS_TRAFFIC.received(received.nbytes + dropped)
        return received

    def _take_grant(self, conn: Connection, session: sessions.Session, port: int) -> None:
        """A SESSION reply: the session (and, the first time, the bulk socket) in use from
        now on, then the requests held meanwhile; port 0 (no bulk channel there): CurveZMQ
        alone on this connection."""
        if not conn.asking:
            return  # not asked for on this connection
        conn.asking = False
        if port == 0:
            conn.bulk_wanted = False
        elif conn.bulk is None:
            if not self._open_bulk(conn, session, port):
                return
        else:
            conn.earlier, conn.session = conn.session, session
        held, conn.held = conn.held, []
        for index, frames in enumerate(held):
            if not self._send_now(conn, frames):  # the queue is full: their attempts' timeouts send them again
                log.warning("event=held_requests_dropped peer=%r count=%d", conn.address, len(held) - index)
                break

    def _open_bulk(self, conn: Connection, session: sessions.Session, port: int) -> bool:
        """The connection to the bulk port started, its hello queued first; False (and the
        held requests dropped: their resends ask anew) when it cannot even start."""
        host = framing.split_address(conn.address)[0]
        try:
            sock = framing.connect(host, port)
        except OSError as exc:
            log.warning("event=bulk_connect_failed peer=%r port=%d error=%r", conn.address, port, str(exc))
            conn.forget_session()
            return False
        conn.bulk = framing.Stream(sock, REPLY_LIMITS, self._pool, expects_hello=False, check_head=conn.check_head)
        conn.session = session
        conn.bulk_endpoint = f"tcp://{host}:{port}"
        conn.bulk.send(memoryview(session.hello()))
        return True

    def _receive_bulk(self, conn: Connection, sink: Sink | None) -> Received | None:
        assert conn.bulk is not None and conn.bulk.message is not None
        message = conn.bulk.message
        try:
            session = conn.session_of(message.prefix)
            if session is None:
                raise errors.BulkRejected("a reply of no session of this link")
            return Received(*sessions.open_reply(session, message, sink))
        except errors.BulkRejected as exc:
            log.warning("event=bulk_refused peer=%r reason=%r", self.address, str(exc))
            conn.forget_session()
            return None
        finally:
            if conn.bulk is not None:
                conn.bulk.done()

    def reconnect(self) -> None:
        """A fresh connection: replies to earlier requests and the requests still queued or
        held are dropped. A link to copies moves to the next copy's connection instead."""
        if len(self.copies.addresses) == 1:
            self._conn.close()
            self._conn = self._connect()
            return
        # The copy may restart before the link comes back, and ZeroMQ reconnects the CurveZMQ
        # socket to the new process unseen: a session kept till then would be one it never granted.
        self._conn.forget_session()
        self._idle[self.address] = self._conn
        self.copies.next()
        idle = self._idle.pop(self.address, None)
        self._conn = idle if idle is not None else self._connect()

    def close(self) -> None:
        for conn in [self._conn, *self._idle.values()]:
            conn.close()
        self._idle.clear()
