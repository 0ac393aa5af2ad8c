"""The interface both transports offer: Server, Link, Transport, and what they carry.

    Server      a bound socket: receive() -> Incoming (the peer, its authenticated user,
                the frames); send(peer, frames)
    Link        one connection to one peer (or to a shard's copies in turn): send, receive
                (array frames straight into the caller's sink), reconnect
    Transport   makes Servers and Links, and waits on several links at once

ZmqTransport (zmq_transport.py) is the roles'; MemoryTransport (memory_transport.py) its
in-process twin for unit tests. This module needs neither ZeroMQ nor the twin.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable, Protocol, Sequence

if TYPE_CHECKING:
    import numpy as np

    from distbelief.runtime.keys import ServerSecurity

STOP_POLL_SECONDS = 0.25  # how often a waiting server or exchange looks at its stop event
MAX_REPLY_FRAMES = 4      # frames after a reply's header that a link reads; more are dropped


Frame = bytes | memoryview
# (header frame, index of a frame after it) -> the array that frame goes into, or None
Sink = Callable[[memoryview, int], "np.ndarray | None"]


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


# -- the interface both transports offer ---------------------------------------------------


class Server(Protocol):
    endpoint: str

    def poll(self, seconds: float, links: Sequence[Link] = ()) -> bool:
        """Whether a request is there to receive(), waiting up to `seconds`, or until one of
        `links` has a reply to read."""
        ...

    def receive(self) -> Incoming | None: ...

    def send(self, peer: bytes, frames: Sequence[Frame]) -> bool: ...

    def close(self) -> None: ...


class Link(Protocol):
    @property
    def address(self) -> str:
        """The address it talks to now (a link to a shard's copies moves between them)."""
        ...

    def readable(self, ready: dict) -> bool: ...

    def broke(self, ready: dict | None = None) -> bool: ...

    def send(self, frames: Sequence[Frame]) -> bool: ...

    def receive(self, sink: Sink | None = None) -> Received | None: ...

    def reconnect(self) -> None: ...

    def close(self) -> None: ...


class Transport(Protocol):
    def server(self, address: str, *, who: str, max_frame: int, max_frames: int,
               security: ServerSecurity | None, bulk: str | None = None) -> Server: ...

    def link(self, address: str | Sequence[str], options: dict | None, *, watch: bool = True,
             bulk: bool = False, heartbeat: float | None = None) -> Link:
        """heartbeat: seconds between pings of the peer's transport (not its serving thread);
        three unanswered count as a broken connection. A link to several copies pings anyway."""
        ...

    def wait(self, links: Sequence[Link], seconds: float) -> dict: ...
