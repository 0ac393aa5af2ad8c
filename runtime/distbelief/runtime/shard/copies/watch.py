"""What a shard copy knows of its shard's other copies: each one's role, view, step,
incarnation (a random name each copy takes when it starts: a copy that restarted is
another incarnation, which the in-sync set of the view record does not name) and, for a
backup, its position (forwarding.py: the last command it applied).

A thread asks every other copy for its COPY_STATUS a few times a second, on its own
sockets, and keeps the newest answer of each with the time it came. The serving thread
reads these when no primary holds the view's lease (replication.Copies): which backup of
the in-sync set takes over (the one furthest along) and which others it keeps in its set;
with none alive, which copy has the newest state (it leads). A copy whose state is not
whole (a transfer broke off and it had no checkpoint to go back to) answers step -1.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Mapping

from distbelief.runtime import errors
from distbelief.runtime.shard.copies.forwarding import Position, position_of
from distbelief.runtime.transport import interface
from distbelief.runtime.wire import protocol

log = logging.getLogger(__name__)

WATCH_SECONDS = 0.25   # between two rounds of questions
ANSWER_SECONDS = 0.5   # how long one round waits for the copies' answers

PRIMARY, BACKUP, SYNCING = "primary", "backup", "syncing"

COPY_STATUS = protocol.define(protocol.OpSpec(30, "COPY_STATUS", reply=protocol.JsonObject, privileged=True))


@dataclasses.dataclass(frozen=True)
class PeerState:
    role: str
    view: int
    step: int
    incarnation: str
    seen: float  # time.monotonic() of the answer
    position: Position | None = None  # a backup's

    def recent(self, now: float, within: float) -> bool:
        return now - self.seen <= within


class Watch:
    """The newest COPY_STATUS of each other copy of one shard (by copy rank)."""

    def __init__(self, *, shard: int, layout: int, addresses: Mapping[int, str], security: dict | None,
                 transport_: interface.Transport) -> None:
        self.shard, self.layout = shard, layout
        self._transport = transport_
        self._links = {rank: transport_.link(address, security, watch=False) for rank, address in addresses.items()}
        self.latest: dict[int, PeerState] = {}
        self.started = time.monotonic()
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"copy-watch-{shard}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for link in self._links.values():
            link.close()

    def heard_from(self, rank: int, within: float) -> PeerState | None:
        """Rank's newest answer if it came within the last `within` seconds."""
        state = self.latest.get(rank)
        return state if state is not None and state.recent(time.monotonic(), within) else None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
            except (errors.RuntimeFailure, ValueError, KeyError, TypeError) as exc:  # a garbled answer: asked again
                log.warning("event=copy_watch_failed shard=%d error=%r", self.shard, str(exc))
            self._stop.wait(WATCH_SECONDS)

    def _round(self) -> None:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        request = [protocol.Header(op=COPY_STATUS.code, shard=self.shard, layout=self.layout, seq=self._seq).pack()]
        for link in self._links.values():
            link.send(request)
        pending = dict(self._links)
        deadline = time.monotonic() + ANSWER_SECONDS
        while pending and time.monotonic() < deadline and not self._stop.is_set():
            ready = self._transport.wait(list(pending.values()), min(0.05, ANSWER_SECONDS))
            for rank, link in list(pending.items()):
                if link.readable(ready) and self._take(rank, link.receive()):
                    del pending[rank]
        for link in pending.values():
            link.reconnect()  # a fresh socket: a late answer must not be read as the next one's

    def _take(self, rank: int, received: interface.Received) -> bool:
        header = protocol.unpack_header(received.header)
        if header.seq != self._seq:
            return False
        if header.status != protocol.Status.OK or not received.frames:
            return True  # refused (a copy of another job?): no news from it
        value = protocol.JsonObject.unpack(received.frames[0]).value
        position = value.get("position")
        self.latest[rank] = PeerState(role=str(value["role"]), view=int(value["view"]), step=int(value["step"]),
                                      incarnation=str(value.get("incarnation", "")), seen=time.monotonic(),
                                      position=None if position is None else position_of(position))
        return True
