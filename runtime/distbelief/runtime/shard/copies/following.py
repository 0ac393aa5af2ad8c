"""A copy's side of its primary's stream (forwarding.py): asking to JOIN, receiving the state
in parts (transfer.py), then applying the forwarded commands, each in its order.

Every message of the stream names its view, its stream and its number; one of another
view, another stream or out of order is refused, never applied (an old primary is fenced
off by the view, a lost message by the number), and the answer says this copy's view, so a
primary of an older one steps down. A forwarded command is applied through the shard
core's own path (Shard.answer) under its first sender's identity, so this copy's resend
record knows it too, and at the time the primary took it (its envelope's `at`), so that
what a plugin decides by time is decided alike on every copy.

A whole copy knows its position (forwarding.Position: the last command it applied, or where
its transfer ended) and keeps the last few commands it applied (RECENT_COMMANDS), so that if
it takes over, a copy of the in-sync set that stood a few commands behind it gets them and
stays in the set. A primary that took over with this copy in its in-sync set sends it a
resume instead of a transfer: if this copy stands where the primary says, it follows the new
view's stream from there.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Protocol, Sequence

from distbelief.runtime import errors
from distbelief.runtime.shard.copies.forwarding import Command, Position, position_of
from distbelief.runtime.shard.copies.transfer import Receiver
from distbelief.runtime.shard.copies.viewstore import ViewRecord
from distbelief.runtime.shard.copies.watch import BACKUP, PRIMARY, SYNCING
from distbelief.runtime.shard.core import Shard
from distbelief.runtime.transport import interface
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Header, JsonObject, OpSpec

log = logging.getLogger(__name__)

JOIN = protocol.define(OpSpec(31, "JOIN", request=JsonObject, privileged=True))
JOIN_RETRY_SECONDS = 3.0      # a JOIN without a transfer begun is sent again after this long
RECENT_COMMANDS = 8           # commands a copy keeps for the copies behind it, should it take over
RECENT_BYTES = 32 << 20       # ... and at most this many bytes of them


class Owner(Protocol):
    """What the follower reads of its copy (replication.Copies)."""

    role: str
    view: int
    incarnation: str
    forwarded: bool

    def installed(self, view: int) -> None:
        """The transfer ended: the copy holds its primary's state and is a backup."""
        ...

    def resumed(self, view: int) -> None:
        """The primary of a newer view took over with this copy in its in-sync set."""
        ...


@dataclasses.dataclass
class Joining:
    view: int
    primary: int
    at: float
    link: interface.Link


class Follower:
    def __init__(self, owner: Owner, shard: Shard, *, rank: int, addresses: Sequence[str], security: dict | None,
                 transport_: interface.Transport) -> None:
        self.owner, self.shard, self.rank, self.addresses = owner, shard, rank, addresses
        self.security, self._transport = security, transport_
        self.stream: str | None = None
        self.number = 0            # the last message of the stream applied
        self.receiver: Receiver | None = None
        self.joining: Joining | None = None
        self.heard = 0.0           # when the stream last brought a message
        self.sound = True          # the state is whole (a broken transfer without a checkpoint: not)
        self.position: Position | None = None  # where the state stands, while it is a whole copy's
        self.recent: collections.deque[Command] = collections.deque()  # the last commands that brought it there

    # -- asking to join ------------------------------------------------------------------------

    def ask_to_join(self, record: ViewRecord, now: float) -> None:
        joining = self.joining
        if joining is not None and (joining.view, joining.primary) == (record.view, record.primary) and \
                now - joining.at < JOIN_RETRY_SECONDS:
            return
        if joining is not None:
            joining.link.close()
        link = self._transport.link(self.addresses[record.primary], self.security, watch=False)
        link.send([Header(op=JOIN.code, shard=self.shard.index, layout=self.shard.layout.hash).pack(),
                   JsonObject({"rank": self.rank, "incarnation": self.owner.incarnation, "view": record.view}).pack()])
        self.joining = Joining(view=record.view, primary=record.primary, at=now, link=link)

    def read_join_answers(self) -> None:
        joining = self.joining
        while joining is not None and joining.link.readable(self._transport.wait([joining.link], 0)):
            received = joining.link.receive()
            if received is None:
                continue
            header = protocol.unpack_header(received.header)
            if header.status == protocol.Status.ERROR:
                text = protocol.decode_text(received.frames[0]) if received.frames else ""
                log.info("event=join_refused shard=%d copy=%d by=%d reason=%r", self.shard.index, self.rank,
                         joining.primary, text)

    # -- the stream's messages -----------------------------------------------------------------

    def replicate(self, header: Header, incoming: interface.Incoming) -> list:
        """REPLICATE: a command the primary applied, to apply here in its order."""
        if len(incoming.frames) < 3:
            raise errors.ProtocolError("REPLICATE carries its envelope and a request")
        envelope = fields(incoming.frames[1])
        refusal = self._out_of_order(envelope)
        if refusal:
            return self.answer(header, applied=False, reason=refusal)
        inner = protocol.unpack_header(incoming.frames[2])
        if inner.op in self.shard.raw_ops:
            raise errors.ProtocolError(f"REPLICATE of {protocol.spec_of(inner.op).name}: only client ops are")
        try:
            peer = bytes.fromhex(envelope["peer"])
        except (KeyError, TypeError, ValueError) as exc:
            raise errors.ProtocolError(f"REPLICATE's sender is not hex: {exc}") from exc
        user, taken_at = envelope.get("user"), envelope.get("at")
        if not isinstance(user, str | None):
            raise errors.ProtocolError("REPLICATE's envelope names no sender")
        if not isinstance(taken_at, int | float) or isinstance(taken_at, bool):
            raise errors.ProtocolError("REPLICATE's envelope has no time the primary took the command at")
        position = position_of(envelope.get("position"))
        self.owner.forwarded = True
        try:
            reply = self.shard.answer(inner, interface.Incoming(peer=peer, user=user, frames=incoming.frames[2:]),
                                      taken_at=float(taken_at))
        finally:
            self.owner.forwarded = False
        self.number, self.heard = envelope["number"], time.monotonic()
        applied = protocol.unpack_header(reply[0]).status != protocol.Status.ERROR
        if not applied:
            self._forget_position()
        elif self.receiver is None:  # a whole copy: it stands where the command did
            self._keep(Command(user=user, peer=envelope["peer"], at=float(taken_at), frames=incoming.frames[2:],
                               position=position, step=self.shard.step))
        return self.answer(header, applied=applied, reason="" if applied else "the command failed here")

    def copy_state(self, header: Header, incoming: interface.Incoming) -> list:
        """COPY_STATE: the transfer's begin, one of its parts, or its end."""
        envelope = fields(incoming.frames[1]) if len(incoming.frames) > 1 else {}
        kind, frames = envelope.get("kind"), incoming.frames[2:]
        if kind == "resume":
            return self._resume(header, envelope)
        if kind == "begin":
            refusal = self._refuse_begin(envelope)
            if refusal:
                return self.answer(header, applied=False, reason=refusal)
            self.receiver = Receiver(self.shard, view=envelope["view"], stream=str(envelope["stream"]))
            self.owner.view, self.stream, self.number = envelope["view"], str(envelope["stream"]), 0
            self._forget_position()  # mixed until the end
        refusal = self._out_of_order(envelope) or (None if self.receiver else "no transfer under way")
        if refusal:
            return self.answer(header, applied=False, reason=refusal)
        assert self.receiver is not None
        try:
            if kind == "begin":
                self.receiver.begin(envelope, frames)
            elif kind == "part":
                self.receiver.part(envelope, frames)
            elif kind == "end":
                self.receiver.end(envelope)
            else:
                raise errors.ProtocolError(f"COPY_STATE of kind {kind!r}")
        except (errors.ProtocolError, errors.ConfigError, KeyError, ValueError, TypeError) as exc:
            self.abort(f"{kind}: {exc}")
            return self.answer(header, applied=False, reason=str(exc))
        self.number, self.heard = envelope["number"], time.monotonic()
        if kind != "end":
            return self.answer(header, applied=True)
        self.receiver, self.sound = None, True
        self.position = position_of(envelope.get("position"))
        self.drop_joining()
        self.owner.installed(envelope["view"])
        return self.answer(header, applied=True, installed=True)

    def _refuse_begin(self, envelope: dict) -> str | None:
        joining = self.joining
        if self.owner.role != SYNCING or joining is None or envelope.get("view") != joining.view:
            return f"not catching up in view {envelope.get('view')!r}"
        if not isinstance(envelope.get("stream"), str) or envelope.get("number") != 1:
            return "a transfer begins with message 1 of its stream"
        self.receiver = None  # a JOIN sent again brings a fresh transfer: the old one is left
        return None

    def _resume(self, header: Header, envelope: dict) -> list:
        """COPY_STATE resume: the primary of a newer view took over with this copy in its
        in-sync set. If this copy stands where that primary says, it follows that view's
        stream from here: the commands it lacks come first."""
        refusal = self._refuse_resume(envelope)
        if refusal:
            log.warning("event=resume_refused shard=%d copy=%d view=%s reason=%r", self.shard.index, self.rank,
                        envelope.get("view"), refusal)
            return self.answer(header, applied=False, reason=refusal)
        self.stream, self.number, self.heard = str(envelope["stream"]), envelope["number"], time.monotonic()
        self.drop_joining()
        self.owner.resumed(envelope["view"])
        return self.answer(header, applied=True, installed=True)

    def _refuse_resume(self, envelope: dict) -> str | None:
        view = envelope.get("view", 0)
        if self.owner.role != BACKUP or self.receiver is not None:
            return f"copy {self.rank} is {self.owner.role}"
        if envelope.get("incarnation") != self.owner.incarnation or view <= self.owner.view:
            return f"not incarnation {envelope.get('incarnation')!r} of this copy in a view before {view}"
        if not isinstance(envelope.get("stream"), str) or envelope.get("number") != 1:
            return "a resume is message 1 of its stream"
        since = position_of(envelope.get("since"))
        if since != self.position:
            return f"this copy stands at {self.position}, not {since}"
        return None

    def _out_of_order(self, envelope: dict) -> str | None:
        """Why a stream's message cannot be applied now (None: it can)."""
        view, number = envelope.get("view"), envelope.get("number")
        if not isinstance(view, int) or not isinstance(number, int):
            raise errors.ProtocolError("a copy's message names no view or number")
        role = self.owner.role
        if role == PRIMARY or (role == SYNCING and self.receiver is None) or role not in (SYNCING, BACKUP):
            return f"copy {self.rank} is {role}"
        if view != self.owner.view:
            return f"view {view}, this copy is in view {self.owner.view}"
        if envelope.get("stream") != self.stream or number != self.number + 1:
            return f"message {number} of stream {envelope.get('stream')}, expected {self.number + 1} of {self.stream}"
        return None

    def answer(self, header: Header, *, applied: bool, reason: str = "", installed: bool = False) -> list:
        value: dict[str, Any] = {"applied": applied, "view": self.owner.view, "number": self.number,
                                 "step": self.shard.step}
        if installed:
            value["installed"] = True
        if reason:
            value["reason"] = reason[:500]
        return protocol.reply_frames(header, step=self.shard.step, meta=JsonObject(value))

    # -- where the state stands ----------------------------------------------------------------

    def since(self, position: Position) -> list[Command] | None:
        """The commands this copy applied after `position`; None if it does not know them all."""
        if position == self.position:
            return []
        recent = list(self.recent)
        found = [i for i, command in enumerate(recent) if command.position == position]
        return recent[found[0] + 1:] if found else None

    def _keep(self, command: Command) -> None:
        """Stand where command did, and keep a copy of it (its frames are the transport's)."""
        self.position = command.position
        if command.nbytes > RECENT_BYTES:
            self.recent.clear()  # the commands kept must follow each other
            return
        self.recent.append(dataclasses.replace(command, frames=[bytes(f) for f in command.frames]))
        kept = sum(c.nbytes for c in self.recent)
        while len(self.recent) > RECENT_COMMANDS or kept > RECENT_BYTES:
            kept -= self.recent.popleft().nbytes

    def _forget_position(self) -> None:
        self.position = None
        self.recent.clear()

    # -- ending it -----------------------------------------------------------------------------

    def abort(self, why: str) -> None:
        """A transfer that broke off: back to the newest checkpoint (sound unless none)."""
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            self.sound = receiver.abort()
            log.warning("event=catch_up_failed shard=%d copy=%d view=%d reason=%r state=%s", self.shard.index,
                        self.rank, receiver.view, why, "checkpoint" if self.sound else "not_whole")
        self.drop()

    def drop(self) -> None:
        """Leave the stream: nothing more of it is applied."""
        self.stream, self.number = None, 0
        self._forget_position()
        self.drop_joining()

    def drop_joining(self) -> None:
        if self.joining is not None:
            self.joining.link.close()
            self.joining = None


def fields(frame: bytes | memoryview) -> dict:
    """A copy's small JSON payload (ProtocolError otherwise)."""
    value = JsonObject.unpack(frame).value
    if not all(isinstance(value.get(k, 0), int) for k in ("view", "number", "rank")):
        raise errors.ProtocolError(f"a copy's payload with a non-integer view or number: {str(value)[:200]}")
    return value
