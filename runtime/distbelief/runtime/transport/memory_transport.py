"""The in-process twin of the transport: the same Server and Link interface as
transport.ZmqTransport, over in-process queues, for unit tests of shards and replicas
without sockets (httpx's MockTransport idea). Addresses are any strings; a link may
connect before its server binds; nothing is authenticated nor encrypted (a bulk
channel is asked for and ignored); frames are copied on send, as a socket would.
"""

from __future__ import annotations

import collections
import threading
from typing import Sequence, cast

import numpy as np

from distbelief.runtime import errors, keys
from distbelief.runtime.transport.copy_addresses import CopyAddresses
from distbelief.runtime.transport.interface import MAX_REPLY_FRAMES, Frame, Incoming, Link, Received, Sink


class MemoryTransport:
    """Servers and links that pass frames through in-process queues: the same interface as
    ZmqTransport, for unit tests of shards and replicas without sockets. Addresses are any
    strings; a link may connect before its server binds. Nothing is authenticated."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._servers: dict[str, "MemoryServer"] = {}
        self._links: dict[bytes, "MemoryLink"] = {}
        self._next_peer = 0

    def server(self, address: str, *, who: str, max_frame: int, max_frames: int,
               security: keys.ServerSecurity | None = None, bulk: str | None = None) -> "MemoryServer":
        with self._changed:
            if address in self._servers:
                raise errors.ConfigError(f"{who} cannot listen on {address}: address in use")
            server = self._servers[address] = MemoryServer(self, address, max_frame=max_frame, max_frames=max_frames)
        return server

    def link(self, address: str | Sequence[str], options: dict | None = None, *, watch: bool = True,
             bulk: bool = False, heartbeat: float | None = None) -> "MemoryLink":
        with self._changed:
            self._next_peer += 1
            peer = self._next_peer.to_bytes(4, "big")
            link = self._links[peer] = MemoryLink(self, address, peer)
        return link

    def wait(self, links: Sequence[Link], seconds: float) -> dict:
        own = cast("Sequence[MemoryLink]", links)  # the links it made
        with self._changed:
            self._changed.wait_for(lambda: any(link.inbox for link in own), timeout=seconds)
            return {link: True for link in own if link.inbox}

    def _deliver_to_server(self, address: str, peer: bytes, frames: list[memoryview]) -> None:
        with self._changed:
            server = self._servers.get(address)
            if server is not None:
                server.inbox.append((peer, frames))
                self._changed.notify_all()

    def _deliver_to_link(self, peer: bytes, frames: list[memoryview]) -> bool:
        with self._changed:
            link = self._links.get(peer)
            if link is None:
                return False
            link.inbox.append(frames)
            self._changed.notify_all()
            return True

    def _unbind(self, address: str) -> None:
        with self._changed:
            self._servers.pop(address, None)


class MemoryServer:
    def __init__(self, transport: MemoryTransport, address: str, *, max_frame: int, max_frames: int) -> None:
        self.transport, self.endpoint = transport, address
        self.max_frame, self.max_frames = max_frame, max_frames
        self.inbox: collections.deque[tuple[bytes, list[memoryview]]] = collections.deque()

    def poll(self, seconds: float, links: Sequence["MemoryLink"] = ()) -> bool:
        with self.transport._changed:
            self.transport._changed.wait_for(lambda: bool(self.inbox) or any(link.inbox for link in links),
                                             timeout=seconds)
            return bool(self.inbox)

    def receive(self) -> Incoming | None:
        with self.transport._changed:
            peer, frames = self.inbox.popleft()
        if len(frames) > self.max_frames or any(len(f) > self.max_frame for f in frames):
            return None
        return Incoming(peer=peer, user=None, frames=frames)

    def send(self, peer: bytes, frames: Sequence[Frame]) -> bool:
        return self.transport._deliver_to_link(peer, [memoryview(bytes(f)) for f in frames])

    def close(self) -> None:
        self.transport._unbind(self.endpoint)


class MemoryLink:
    def __init__(self, transport: MemoryTransport, address: str | Sequence[str], peer: bytes) -> None:
        self.transport, self.copies, self.peer = transport, CopyAddresses(address), peer
        self.inbox: collections.deque[list[memoryview]] = collections.deque()

    @property
    def address(self) -> str:
        return self.copies.address

    def readable(self, ready: dict) -> bool:
        return self in ready

    def broke(self, ready: dict | None = None) -> bool:
        return False

    def send(self, frames: Sequence[Frame]) -> bool:
        # A copy, as a socket would make: the sender may reuse its buffers at once.
        self.transport._deliver_to_server(self.address, self.peer, [memoryview(bytes(f)) for f in frames])
        return True

    def receive(self, sink: Sink | None = None) -> Received:
        with self.transport._changed:
            header, *rest = self.inbox.popleft()
        frames: list[memoryview] = []
        into_sink = 0
        for index, frame in enumerate(rest[:MAX_REPLY_FRAMES]):
            target = sink(header, index) if sink is not None else None
            if target is None:
                frames.append(frame)
                continue
            flat = target.reshape(-1).view(np.uint8)  # recv_into's rule: copy what fits, count all
            fits = min(len(frame), flat.size)
            flat[:fits] = np.frombuffer(frame, dtype=np.uint8, count=fits)
            into_sink += len(frame)
        return Received(header=header, frames=frames, into_sink=into_sink)

    def reconnect(self) -> None:
        with self.transport._changed:
            self.inbox.clear()
        self.copies.next()

    def close(self) -> None:
        with self.transport._changed:
            self.transport._links.pop(self.peer, None)
