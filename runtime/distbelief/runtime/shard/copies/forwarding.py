"""The primary's streams to the other copies of its shard: what went out to each, what each
acknowledged, and which are slow or dead.

Each copy that asked to join gets a Stream: its own link, a random id, and numbered
messages in one order: the transfer's first message (transfer.py), then every command the
primary applies (REPLICATE, forwarded as it came with its sender's identity) interleaved
with the parts of the state, then the transfer's end. The copy applies them in that order
and acknowledges each by number (a gap is refused). A stream is *installed* once its copy
acknowledged the transfer's end: from then on every reply the primary gives waits for its
acknowledgement (it may be added to the in-sync set). Sending never waits: the serving
thread goes on, and the acknowledgements are read between requests (pump()).

Each forwarded command names its *position*: its view and its number among the commands of
that view. Two copies at one position hold the same state, so a primary that took over keeps
the copies of the old in-sync set at its own position, or a few commands behind it, in its
set: their stream (resume()) opens with the commands they lack, which it applied as a
backup, and is installed at once, with no transfer.

A stream is given up (drop_reasons) when its link broke, its heartbeat (the transport's,
which the copy's serving thread does not answer) timed out, or a message stayed
unacknowledged for FORWARD_SECONDS (slow); the caller takes an installed one out of the
in-sync set first.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import secrets
import time
from typing import Any, Sequence

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.shard.copies.transfer import COPY_STATE, Sender
from distbelief.runtime.transport import interface
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Header, JsonObject, OpSpec

log = logging.getLogger(__name__)

REPLICATE = protocol.define(OpSpec(32, "REPLICATE", privileged=True))
FORWARD_SECONDS = 3.0       # a message unacknowledged this long: the copy is too slow, given up
HEARTBEAT_SECONDS = 0.5     # the transport pings each stream's copy; 3 missed: dead
WINDOW_BYTES = 256 << 20    # unacknowledged bytes to an installed copy before the primary stops taking requests
WINDOW_MESSAGES = 512      # below the transport's send queue (1000 messages): it never fills first
PARTS_WINDOW_BYTES = 64 << 20  # unacknowledged bytes to a copy catching up before its next part waits


Position = tuple[int, int]  # (view, number of the command in that view): where a copy's state stands


def position_of(value: object) -> Position:
    """A position as the wire carries it, [view, number] (ProtocolError otherwise)."""
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)):
        raise errors.ProtocolError(f"a copy's position that is not [view, number]: {str(value)[:100]}")
    return value[0], value[1]


@dataclasses.dataclass(frozen=True)
class Command:
    """A command as the primary forwarded it: its sender (user, peer as hex), the primary's
    time when it took it, its request's frames; its position and the step after it."""

    user: str | None
    peer: str
    at: float
    frames: Sequence[bytes | memoryview]
    position: Position
    step: int

    @property
    def nbytes(self) -> int:
        return sum(len(f) for f in self.frames)


@dataclasses.dataclass
class Sent:
    number: int
    seq: int          # the commands forwarded up to and with this message
    nbytes: int
    at: float
    step: int | None  # the primary's step after it (None: the copy's to tell)


@dataclasses.dataclass
class Stream:
    rank: int
    incarnation: str
    link: interface.Link
    id: str
    transfer: Sender | None
    sent: int = 0
    acked: int = 0
    acked_seq: int = 0
    installed: bool = False
    in_flight: int = 0
    unsent: bool = False    # a message could not even be queued
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)
    failure: str | None = None

    @property
    def member(self) -> tuple[int, str]:
        return self.rank, self.incarnation


class Chain:
    """Every stream of this primary, in one term (a view of this primary)."""

    def __init__(self, *, shard: int, layout: int, view: int, transport_: interface.Transport,
                 security: dict | None) -> None:
        self.shard, self.layout, self.view = shard, layout, view
        self._transport, self._security = transport_, security
        self.streams: dict[tuple[int, str], Stream] = {}
        self.seq = 0   # commands forwarded in this term

    # -- streams -----------------------------------------------------------------------------

    def open(self, rank: int, incarnation: str, address: str, transfer: Sender) -> Stream:
        """A stream to a copy that asked to join, its transfer's first message sent."""
        link = self._transport.link(address, self._security, bulk=True, heartbeat=HEARTBEAT_SECONDS)
        stream = Stream(rank=rank, incarnation=incarnation, link=link, id=secrets.token_hex(8), transfer=transfer)
        self.streams[stream.member] = stream
        self._send(stream, self._state_frames(stream, *transfer.begin()), step=transfer.step)
        return stream

    def resume(self, rank: int, incarnation: str, address: str, *, since: Position,
               commands: Sequence[Command] | None) -> Stream:
        """An installed stream to a copy of the in-sync set this primary took over with, whose
        state stood at `since`: the commands it lacks (None: they are not all known, the
        stream is given up at once), then every command from now on."""
        link = self._transport.link(address, self._security, bulk=True, heartbeat=HEARTBEAT_SECONDS)
        stream = Stream(rank=rank, incarnation=incarnation, link=link, id=secrets.token_hex(8), transfer=None,
                        installed=True)
        self.streams[stream.member] = stream
        if commands is None:
            stream.failure = f"it stood at {since}, this primary knows not every command since"
            return stream
        resume = {"kind": "resume", "incarnation": incarnation, "since": list(since)}
        self._send(stream, self._state_frames(stream, resume, []), step=None)
        for command in commands:
            self._send(stream, self._replicate_frames(stream, command), step=command.step)
        return stream

    def close(self, stream: Stream) -> None:
        self.streams.pop(stream.member, None)
        stream.link.close()

    def close_all(self) -> None:
        for stream in list(self.streams.values()):
            self.close(stream)

    def installed(self) -> list[Stream]:
        return [s for s in self.streams.values() if s.installed]

    def links(self) -> list[interface.Link]:
        return [s.link for s in self.streams.values()]

    # -- sending -------------------------------------------------------------------------------

    def forward(self, incoming: interface.Incoming, *, step: int, taken_at: float) -> None:
        """A command just applied (taken at taken_at by this primary's clock): to every
        stream, in order."""
        self.seq += 1
        command = Command(user=incoming.user, peer=incoming.peer.hex(), at=taken_at, frames=incoming.frames,
                          position=(self.view, self.seq), step=step)
        for stream in self.streams.values():
            self._send(stream, self._replicate_frames(stream, command), step=step)

    def _replicate_frames(self, stream: Stream, command: Command) -> list[Any]:
        number = stream.sent + 1
        envelope = self._envelope(stream, number, user=command.user, peer=command.peer, at=command.at,
                                  position=list(command.position))
        head = Header(op=REPLICATE.code, shard=self.shard, layout=self.layout, seq=number, step=command.step).pack()
        return [head, envelope, *command.frames]

    def send_parts(self, step: int, budget: int) -> None:
        """Parts of the state to the streams still transferring, while their window has room;
        then each one's end."""
        for stream in list(self.streams.values()):
            transfer = stream.transfer
            while transfer is not None and stream.in_flight < budget and stream.failure is None:
                part = transfer.next()
                if part is None:
                    stream.transfer = None
                    break
                self._send(stream, self._state_frames(stream, *part), step=step)

    def _state_frames(self, stream: Stream, fields: dict[str, Any], arrays: Sequence[Any]) -> list[Any]:
        number = stream.sent + 1
        head = Header(op=COPY_STATE.code, shard=self.shard, layout=self.layout, seq=number).pack()
        return [head, self._envelope(stream, number, position=[self.view, self.seq], **fields),
                *(a if isinstance(a, bytes) else np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays)]

    def _envelope(self, stream: Stream, number: int, **fields: Any) -> bytes:
        return json.dumps({"view": self.view, "stream": stream.id, "number": number, **fields}).encode()

    def _send(self, stream: Stream, frames: Sequence[Any], *, step: int | None) -> None:
        stream.sent += 1
        nbytes = interface.frames_nbytes(frames)
        stream.pending.append(Sent(stream.sent, self.seq, nbytes, time.monotonic(), step))
        stream.in_flight += nbytes
        if not stream.link.send(frames):
            stream.unsent = True

    # -- acknowledgements ------------------------------------------------------------------------

    def pump(self) -> None:
        """Read what the streams' copies answered (without waiting), and note the failures."""
        if not self.streams:
            return
        ready = self._transport.wait(self.links(), 0)
        now = time.monotonic()
        for stream in list(self.streams.values()):
            while stream.link.readable(ready) and stream.failure is None:
                received = stream.link.receive()
                if received is not None:
                    self._take(stream, received)
                ready = self._transport.wait([stream.link], 0)
            if stream.failure is None:
                stream.failure = self._failure(stream, now)

    def _failure(self, stream: Stream, now: float) -> str | None:
        if stream.link.broke():
            return "disconnected"
        if stream.unsent:
            return "queue full"
        if stream.pending and now - stream.pending[0].at > FORWARD_SECONDS:
            return f"silent for {now - stream.pending[0].at:.1f} s"
        return None

    def _take(self, stream: Stream, received: interface.Received) -> None:
        try:
            header = protocol.unpack_header(received.header)
            answer = JsonObject.unpack(received.frames[0]).value if header.status == protocol.Status.OK else {}
        except (errors.ProtocolError, IndexError):
            answer = {}
        number = answer.get("number")
        if answer.get("applied") and not isinstance(number, int):
            stream.failure = "an acknowledgement without its message's number"
            return
        if not answer.get("applied"):
            view = answer.get("view")
            if isinstance(view, int) and view > self.view:
                raise errors.NotPrimary(f"copy {stream.rank} of shard {self.shard} is in newer view {view}")
            stream.failure = f"refused: {answer.get('reason', 'an error reply')}"
            return
        while stream.pending and stream.pending[0].number <= number:
            done = stream.pending.popleft()
            stream.in_flight -= done.nbytes
            stream.acked, stream.acked_seq = done.number, done.seq
            if done.number == number and done.step is not None and answer.get("step") != done.step:
                stream.failure = f"diverged: step {answer.get('step')} where the primary had {done.step}"
        if answer.get("installed"):
            stream.installed = True

    def settled(self, seq: int) -> bool:
        """Whether every installed stream acknowledged the commands up to seq."""
        return all(s.acked_seq >= seq for s in self.streams.values() if s.installed)

    def full(self) -> bool:
        """Too much unacknowledged to an installed copy: take no request until it answers."""
        return any(s.in_flight >= WINDOW_BYTES or len(s.pending) >= WINDOW_MESSAGES for s in self.installed())
