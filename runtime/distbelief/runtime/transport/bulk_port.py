"""A server's bulk port: where an encrypted job's AES-GCM sessions send their messages.

A TCP listener (and on Linux a Unix socket beside it, for peers on the same machine) and
their connections (framing.py). A connection is admitted by its hello,
a proof of a session the server granted over CurveZMQ (sessions.py); until then it is
read no further than the hello, at most MAX_UNPROVEN such connections are kept, and none
for longer than HELLO_SECONDS. An admitted connection carries only the sessions of the
peer its hello proved; a peer keeps at most CONNECTIONS_PER_PEER of them, and none once
the session table forgot its last session. A connection that breaks the framing, or sends
a message that fails its counter or a tag, is closed (the refusal is logged at a bounded
rate), and nothing of it reaches the shard. The messages being read, across connections,
are held to a budget of bytes (framing.Budget): one that does not fit waits, unread.
"""

from __future__ import annotations

import socket
import time
from typing import Sequence

from distbelief.runtime import errors
from distbelief.runtime.observe.traffic import PROCESS_TRAFFIC
from distbelief.runtime.transport import framing, localsocket, sessions
from distbelief.runtime.transport.interface import Frame, Incoming, frames_nbytes

MAX_UNPROVEN = 64        # connections without their hello yet; the oldest goes first
HELLO_SECONDS = 10.0     # a connection's hello must come this soon
SEND_HWM = 64            # replies queued for one connection before further ones are dropped
SEND_HWM_BYTES = 64 << 20  # ...or this many bytes (one reply always gets in)
POOL_KEEP = 2            # buffers kept for the next messages, across connections
# A link uses one bulk connection at a time; a second lets its next one in (after a break,
# a fresh session) before the shard has seen the first one close, or ever will (a silent
# network). A hello beyond it closes the peer's oldest connection.
CONNECTIONS_PER_PEER = 2
# Bytes of requests read at once, across connections: 4 of the largest frame (a push
# carries one, its slice), so a few replicas' pushes are read at once; a message larger
# than that (more frames) is read alone. One that does not fit waits, unread, in its
# socket rather than being refused: a burst of honest pushes is slowed, not failed.
BUDGET_FRAMES = 4
# While a message waits for the budget, a connection that has held its share longer than
# this is closed: trickled bytes keep a replica's push (the newest waiter, let in first)
# waiting about this long, well within its attempt (10 s).
HOLD_SECONDS = 5.0


class BulkPort:
    """The listener and connections of a server's bulk port (`tcp://HOST:PORT`)."""

    def __init__(self, address: str, *, who: str, limits: framing.Limits, table: sessions.Table) -> None:
        self.listener = framing.listen(address)
        host = framing.split_address(address)[0]
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"tcp://{host}:{self.port}"
        self.local = localsocket.listen_local(self.port)  # the same port, for peers on this machine
        self.limits, self._table = limits, table
        self._budget = framing.Budget(BUDGET_FRAMES * limits.max_frame)
        self._streams: list[framing.Stream] = []
        self._pool = framing.BufferPool(keep=POOL_KEEP)
        self._refusals = sessions.RefusalLog(who)

    def watched(self) -> list[tuple[int, bool, bool]]:
        """What to poll: (file descriptor, whether to read it, whether it waits to write). A
        connection whose message waits for the budget is not read."""
        listeners = [(listener.fileno(), True, False) for listener in self._listeners()]
        return [*listeners, *((s.fd, not s.waiting, s.queued > 0) for s in self._streams)]

    def _listeners(self) -> list[socket.socket]:
        return [self.listener] if self.local is None else [self.listener, self.local]

    def serve(self, ready: dict) -> list[Incoming]:
        """Accept new connections, write what waits, and the requests that came whole; then,
        every round (so no timer waits for another connection), close the connections past
        their time and let waiting messages in."""
        for listener in self._listeners():
            if listener.fileno() in ready:
                self._accept(listener)
        incoming = [request for stream in self._streams if stream.ready_in(ready) for request in self._serve(stream)]
        self._close_unproven()
        self._close_forgotten()
        self._let_in()
        self._streams = [s for s in self._streams if not s.closed]
        return incoming

    def send(self, session: sessions.Session, frames: Sequence[Frame]) -> bool:
        """A reply sealed and queued on the connection of the session's last request; False
        when that connection is gone or its queue is full (a peer that does not read its
        replies gets no more piled up for it)."""
        stream = session.route
        if stream is None or stream.closed or stream.queued >= SEND_HWM or (
                stream.queued and stream.queued_bytes + frames_nbytes(frames) > SEND_HWM_BYTES):
            return False
        data, buffer = session.seal_into(sessions.TO_CLIENT, frames, self._pool)
        stream.send(data, buffer)
        PROCESS_TRAFFIC.sent(len(data))
        return True

    def close(self) -> None:
        self.listener.close()
        if self.local is not None:
            localsocket.unlink_local(self.local)
        for stream in self._streams:
            stream.close()
        self._streams.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # out of descriptors, or the peer left already
                self._refusals.refused(f"accept failed: {exc}")
                break
            self._streams.append(framing.Stream(sock, self.limits, self._pool, expects_hello=True,
                                                check_head=self._check_head, budget=self._budget))

    def _close_unproven(self) -> None:
        """Connections still without their hello: late ones closed, and the oldest beyond MAX_UNPROVEN."""
        now = time.monotonic()
        unproven = [s for s in self._streams if s.owner is None]
        for index, stream in enumerate(unproven):
            if now - stream.opened > HELLO_SECONDS or index < len(unproven) - MAX_UNPROVEN:
                self._refusals.refused("a connection without a hello in time")
                stream.close()

    def _close_forgotten(self) -> None:
        """Connections of a peer none of whose sessions the table still holds: so a peer's
        connections count among the table's bounds."""
        for stream in self._streams:
            if stream.owner is not None and not stream.closed and not self._table.knows(stream.owner):
                self._refusals.refused("a connection of a peer whose sessions were all forgotten")
                stream.close()

    def _let_in(self) -> None:
        """Waiting messages let in as the budget allows; while one still waits, the
        connections that held their share longer than HOLD_SECONDS are closed for it."""
        self._budget.grant()
        for stream in self._budget.overdue(HOLD_SECONDS):
            self._refusals.refused("a message that held the byte budget too long while others waited")
            stream.close()
        self._budget.grant()

    def _serve(self, stream: framing.Stream) -> list[Incoming]:
        """A connection's hello, and at most one whole request a round: so the requests
        opened for the shard in a round are within the budget, and each connection gets its turn."""
        try:
            while not stream.closed and stream.message is None:
                PROCESS_TRAFFIC.received(stream.pump())
                if stream.hello is None:
                    break
                self._admit(stream, stream.hello)
            if stream.message is not None:
                request = self._open(stream, stream.message)
                stream.done()
                return [request]
        except errors.BulkRejected as exc:
            self._refusals.refused(str(exc))
            stream.close()
        return []

    def _admit(self, stream: framing.Stream, hello: bytes) -> None:
        session = self._table.find(framing.HELLO.unpack(hello)[1])
        session.check_hello(hello)
        stream.admit(session.owner)
        mine = [s for s in self._streams if s.owner == session.owner and s is not stream and not s.closed]
        for oldest in mine[:max(0, len(mine) - CONNECTIONS_PER_PEER + 1)]:
            self._refusals.refused(f"a connection beyond its peer's {CONNECTIONS_PER_PEER} (the oldest is closed)")
            oldest.close()

    def _session_of(self, stream: framing.Stream, session_id: bytes) -> sessions.Session:
        session = self._table.find(session_id)
        if session.owner != stream.owner:
            raise errors.BulkRejected("a message of a session its connection's hello did not prove")
        return session

    def _check_head(self, stream: framing.Stream, head: bytes, tag: bytes) -> None:
        self._session_of(stream, framing.HEAD.unpack_from(head)[0]).check_head(sessions.TO_SERVER, head, tag)

    def _open(self, stream: framing.Stream, message: framing.Message) -> Incoming:
        session = self._session_of(stream, message.session_id)
        frames = sessions.open_request(session, message)
        self._table.route(session, stream)
        return Incoming(peer=session.peer, user=session.user, frames=frames)
