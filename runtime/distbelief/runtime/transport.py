"""Every socket of the runtime, client and server side, behind one small interface.

    Transport     makes Servers and Links; ZmqTransport (ZeroMQ over tcp:// or ipc://) for
                  the roles; memory_transport.MemoryTransport, an in-process twin for unit tests
    Server        a bound ROUTER: admission of the job's keys, message size and queue
                  bounds; receive() -> Incoming (the peer, its authenticated user, frames)
    Link          one DEALER to one shard, made anew after a silence or a disconnect (to
                  the shard's next copy in turn, when it has backups)
    exchange()    one request to several links at once, the replies collected under one
                  RetryPolicy (attempt timeout, resend on disconnect, give up)

Every socket counts the bytes it sends and receives in traffic.PROCESS_TRAFFIC.

ZeroMQ's errors are translated here into distbelief.runtime.errors and nowhere else;
no other module of the runtime imports zmq (keys.py registers the ZAP handler for it).
Frames are memoryviews (or bytes) on both sides; parameter payloads are received
straight into the caller's array (Link.receive's sink), so a pull costs one copy.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from distbelief.runtime import errors, keys
from distbelief.runtime.traffic import PROCESS_TRAFFIC
from distbelief.runtime.failover import Copies

log = logging.getLogger(__name__)

STOP_POLL_SECONDS = 0.25  # how often a waiting exchange looks at its stop event
SEND_HWM = 64             # replies queued for one peer before further ones are dropped
# libzmq checks ZMQ_MAXMSGSIZE against a frame as it arrives, and CurveZMQ's box (flags,
# nonce, MAC: 33 bytes) arrives around every frame: a frame of exactly the allowed size
# must still get in.
FRAME_OVERHEAD = 64
RECEIVE_HWM = 256         # requests queued from one peer before it is pushed back
HEARTBEAT_MS = 1000       # a link to a shard's copies pings each; 3 missed pongs count as a disconnect
# What accept() returns for a reply that sends the request elsewhere (a shard copy that is
# not the primary): it goes again at once, on a fresh connection to the next copy.
REDIRECT = "redirect"

Frame = bytes | memoryview
# (header frame, index of a frame after it) -> the array that frame goes into, or None
Sink = Callable[[memoryview, int], "np.ndarray | None"]
MAX_REPLY_FRAMES = 4


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How a client waits for a peer: each attempt gets `attempt` seconds, then the request
    goes again on a fresh connection; after `give_up` seconds without an answer the peer is
    unavailable (None: never give up). A broken connection resends at once when
    `resend_on_disconnect` (a restarted shard then costs its restart time, not a timeout)."""

    attempt: float = 10.0
    give_up: float | None = 300.0
    resend_on_disconnect: bool = True


@dataclasses.dataclass(frozen=True)
class Incoming:
    """One request a Server received: reply to `peer` (the connection's routing id); `user`
    is who the handshake proved the peer to be (its ZAP User-Id: a public key, or a PLAIN
    user name), or None on an unauthenticated server."""

    peer: bytes
    user: str | None
    frames: list[memoryview]

    @property
    def nbytes(self) -> int:
        return sum(len(f) for f in self.frames)


@dataclasses.dataclass(frozen=True)
class Received:
    """A reply a Link read: the header frame, the frames after it that did not go into the
    sink's array, and the bytes that did."""

    header: memoryview
    frames: list[memoryview] = dataclasses.field(default_factory=list)
    into_sink: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(len(f) for f in self.frames) + self.into_sink


def frames_nbytes(frames: Iterable[Frame]) -> int:
    return sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)


# -- ZeroMQ ------------------------------------------------------------------------------


class ZmqServer:
    def __init__(self, context: zmq.Context, address: str, *, who: str, max_frame: int, max_frames: int,
                 security: keys.ServerSecurity | None) -> None:
        self.who, self.max_frames = who, max_frames
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.MAXMSGSIZE, max_frame + FRAME_OVERHEAD)
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        socket.setsockopt(zmq.LINGER, 1000)
        self._admission = keys.bind_server(context, socket, address, who=who,
                                           domain=f"distbelief-{who.replace(' ', '-')}-{id(self):x}",
                                           security=security)
        self._socket = socket
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def poll(self, seconds: float) -> bool:
        return bool(self._socket.poll(int(seconds * 1000)))

    def receive(self) -> Incoming | None:
        """The next request, or None when it must be dropped (more frames than any op has)."""
        frames = self._socket.recv_multipart(copy=False)
        PROCESS_TRAFFIC.received(sum(len(f) for f in frames[1:]))
        if len(frames) - 1 > self.max_frames:
            return None
        user = frames[-1].get("User-Id") if self._admission is not None else None
        return Incoming(peer=frames[0].bytes, user=user,
                        frames=[f.buffer for f in frames[1:]])

    def send(self, peer: bytes, frames: Sequence[Frame]) -> bool:
        """Queue a reply; False when the peer's queue is full (it does not read its replies)."""
        try:
            self._socket.send_multipart([peer, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            log.warning("event=reply_failed server=%r error=%r", self.who, str(exc))
            return False
        PROCESS_TRAFFIC.sent(frames_nbytes(frames))
        return True

    def close(self) -> None:
        self._socket.close()
        if self._admission is not None:
            self._admission.close()
            self._admission = None


class ZmqLink:
    """One DEALER socket to one address (or to one of a shard's copies in turn). With watch,
    a monitor reports broken connections; it is read by broke(), or its queue fills and
    stalls the context's I/O thread.

    Every connection of a link carries one random routing id: the server names the peer by
    it (Incoming.peer), so a resend on a fresh connection is still the same peer's, and no
    other peer, key holder or not, can pass for it without guessing 128 bits. A link to a
    shard's copies keeps one connection to each (heartbeats notice a dead node) and moves
    between them: a second connection with the same id would take over the first, and
    ZeroMQ renames it, so its queued requests would count as another peer's."""

    def __init__(self, context: zmq.Context, address: str | Sequence[str], options: dict | None, *,
                 watch: bool) -> None:
        self.context, self.copies, self.options, self.watch = context, Copies(address), options, watch
        self.routing_id = os.urandom(16)
        self._idle: dict[str, tuple[zmq.Socket, zmq.Socket | None, bool]] = {}  # the other copies' connections
        self._socket, self._monitor = self._connect()

    @property
    def address(self) -> str:
        return self.copies.address

    def _connect(self) -> tuple[zmq.Socket, zmq.Socket | None]:
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
        return [self._socket] if self._monitor is None else [self._socket, self._monitor]

    def readable(self, ready: dict) -> bool:
        return self._socket in ready

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
        try:
            self._socket.send_multipart(list(frames), copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False  # the queue to this peer is full: the attempt's timeout sends again
        PROCESS_TRAFFIC.sent(frames_nbytes(frames))
        return True

    def receive(self, sink: Sink | None = None) -> Received:
        header = self._socket.recv(copy=False).buffer
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

    def close(self) -> None:
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
               security: keys.ServerSecurity | None) -> ZmqServer:
        return ZmqServer(self.context, address, who=who, max_frame=max_frame, max_frames=max_frames,
                         security=security)

    def link(self, address: str | Sequence[str], options: dict | None, *, watch: bool = True) -> ZmqLink:
        return ZmqLink(self.context, address, options, watch=watch)

    def wait(self, links: Sequence[ZmqLink], seconds: float) -> dict:
        poller = zmq.Poller()
        for link in links:
            for pollable in link.pollables():
                poller.register(pollable, zmq.POLLIN)
        return dict(poller.poll(seconds * 1000))


# -- the interface both transports offer ---------------------------------------------------


class Server(Protocol):
    endpoint: str

    def poll(self, seconds: float) -> bool: ...

    def receive(self) -> Incoming | None: ...

    def send(self, peer: bytes, frames: Sequence[Frame]) -> bool: ...

    def close(self) -> None: ...


class Link(Protocol):
    address: str

    def readable(self, ready: dict) -> bool: ...

    def broke(self, ready: dict | None = None) -> bool: ...

    def send(self, frames: Sequence[Frame]) -> bool: ...

    def receive(self, sink: Sink | None = None) -> Received: ...

    def reconnect(self) -> None: ...

    def close(self) -> None: ...


class Transport(Protocol):
    def server(self, address: str, *, who: str, max_frame: int, max_frames: int,
               security: keys.ServerSecurity | None) -> Server: ...

    def link(self, address: str | Sequence[str], options: dict | None, *, watch: bool = True) -> Link: ...

    def wait(self, links: Sequence[Link], seconds: float) -> dict: ...


def default() -> ZmqTransport:
    return ZmqTransport()


# -- one request to several peers at once --------------------------------------------------


@dataclasses.dataclass
class Exchange:
    """The state of one request sent to several links: what each gets, what came back."""

    links: Sequence[Link]
    requests: Sequence[Sequence[Frame]]
    policy: RetryPolicy
    names: Sequence[str]  # how errors name each peer ("shard 1 at tcp://...")
    bytes_out: int = 0
    resends: int = 0


def exchange(transport: Transport, ex: Exchange, *, accept: Callable[[int, Received], bool | str],
             stop: threading.Event, sink: Callable[[int], Sink | None] = lambda i: None) -> None:
    """Send requests[i] to links[i] for every i, then wait until accept(i, reply) has said
    True for each. A reply accept() turns down (a stale answer to an earlier attempt) is
    skipped; one it answers REDIRECT sends the request to the link's next copy. A link that breaks gets the request again at once (once per attempt); one
    silent for policy.attempt gets it again on a fresh connection; one silent for
    policy.give_up raises ShardUnavailable. A set stop raises Stopped."""
    pending = set(range(len(ex.links)))
    for i in pending:
        ex.links[i].broke()  # a break before this request cost it nothing
        _send(ex, i)
    started = time.monotonic()
    attempt_deadline = started + ex.policy.attempt
    resent: set[int] = set()
    while pending:
        if stop.is_set():
            raise errors.Stopped("stopped while waiting for an answer")
        timeout = min(STOP_POLL_SECONDS, max(0.0, attempt_deadline - time.monotonic()))
        ready = transport.wait([ex.links[i] for i in pending], timeout)
        for i in list(pending):
            link = ex.links[i]
            verdict = accept(i, _receive(link, sink(i))) if link.readable(ready) else False
            if verdict == REDIRECT:
                _resend(ex, i)
            elif verdict:
                pending.discard(i)  # a reply that beat a disconnect counts
            elif ex.policy.resend_on_disconnect and link.broke(ready) and i not in resent:
                resent.add(i)
                log.warning("event=peer_disconnected peer=%r action=resend", ex.names[i])
                _resend(ex, i)
        if pending and time.monotonic() >= attempt_deadline:
            _retry_silent(ex, pending, time.monotonic() - started)
            attempt_deadline = time.monotonic() + ex.policy.attempt
            resent.clear()


def _receive(link: Link, sink: Sink | None) -> Received:
    try:
        return link.receive(sink)
    except zmq.ZMQError as exc:
        raise errors.ProtocolError(f"reading a reply from {getattr(link, 'address', '?')} failed: {exc}") from exc


def _send(ex: Exchange, i: int) -> None:
    if ex.links[i].send(ex.requests[i]):
        ex.bytes_out += frames_nbytes(ex.requests[i])


def _resend(ex: Exchange, i: int) -> None:
    ex.resends += 1
    ex.links[i].reconnect()
    _send(ex, i)


def _retry_silent(ex: Exchange, pending: set[int], waited: float) -> None:
    give_up = ex.policy.give_up
    for i in pending:
        if give_up is not None and waited >= give_up:
            raise errors.ShardUnavailable(f"{ex.names[i]} has not answered for {waited:.0f} s")
        log.warning("event=peer_silent peer=%r waited_s=%.1f action=reconnect", ex.names[i], waited)
        _resend(ex, i)
