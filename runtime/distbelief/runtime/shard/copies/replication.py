"""Copies of one shard (spec.parameterServers.backups): a primary and its backups.

Every copy runs the same shard core and plugins. Only the primary serves clients; after it
applies a command (a push, a sparse push, DONE) it sends the request as it came, with the
sender's identity (ZAP user, routing id), to each of its backups (REPLICATE), which apply it
through the same core path, record it in their resend record under that sender, and ack.
The reply leaves the primary only once every backup acked, so an acknowledged update is
on every copy; a resend that reaches a new primary is answered from its record, never
applied twice.

Views. A copy's view is a number whose residue modulo the number of copies is the rank of
its primary, so two copies never claim the same view. A copy is SYNCING (it started, or
learnt its view is over), BACKUP (it caught up from the primary of its view, JOIN: the
primary's whole state, then every command) or PRIMARY.

- A SYNCING copy catches up from whichever copy says it is primary (the newest view).
  When none does and every other copy answers SYNCING (a whole job starting), or
  STARTUP_GRACE_SECONDS passed with no primary, the copy with the newest state (then the
  lowest rank) becomes primary.
- A BACKUP promotes itself when a client asks it (clients only come when the primary does
  not answer them) and its primary has not answered for PROMOTE_AFTER_SECONDS, or answers
  that it is no longer primary of this view; a backup nearer after the old primary in
  rank order goes first. The new view is the next one this copy owns.
- A primary drops a backup that broke its connection, stayed silent for FORWARD_SECONDS
  or refused a forward, and moves to its next view, so the dropped copy learns it is
  behind and catches up again. A primary that meets a newer primary steps down.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Mapping, Sequence

from distbelief.runtime import errors
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.copies.watch import BACKUP, COPY_STATUS, PRIMARY, SYNCING, Watch
from distbelief.runtime.shard.core import Shard
from distbelief.runtime.shard.plugin import RawHandler
from distbelief.runtime.transport import fanout, interface, zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Header, JsonObject, OpSpec

log = logging.getLogger(__name__)

PROMOTE_AFTER_SECONDS = 1.0   # a primary silent this long is taken for dead (by a backup a client asks)
FORWARD_SECONDS = 5.0         # a backup silent this long for a forward is dropped
JOIN_SECONDS = 20.0           # the longest a catch-up may take
STARTUP_GRACE_SECONDS = 30.0  # with no primary, wait this long for silent copies before leading
DECIDE_SECONDS = 0.2          # how often the serving loop looks at what the watch saw
MAX_STATE_JSON = 64 << 20

JOIN = protocol.define(OpSpec(31, "JOIN", request=JsonObject, privileged=True))
REPLICATE = protocol.define(OpSpec(32, "REPLICATE", privileged=True))
ROLES = {SYNCING: 0, BACKUP: 1, PRIMARY: 2}


class Copies:
    """This copy of a shard, among addresses (every copy's, by rank). The role hands it to the
    shard's core (Shard.serve_copies), which then asks it what plugin.Replication says."""

    extra_frames = 2  # a forwarded request: its own header and envelope, then the request's frames

    def __init__(self, shard: Shard, *, rank: int, addresses: Sequence[str], security: dict | None,
                 transport_: interface.Transport | None = None) -> None:
        if not 0 <= rank < len(addresses):
            raise errors.ConfigError(f"copy {rank} of shard {shard.index}, which has {len(addresses)} copies")
        self.shard, self.rank, self.addresses, self.security = shard, rank, list(addresses), security
        self._transport = transport_ or zmq_transport.default()
        self.role, self.view, self.failovers = SYNCING, 0, 0
        self.chain: dict[int, interface.Link] = {}  # the primary's backups, by rank
        self.watch = Watch(shard=shard.index, layout=shard.layout.hash, security=security, transport_=self._transport,
                           addresses={r: a for r, a in enumerate(addresses) if r != rank})
        self._started = False
        self._forwarded = False  # applying a request the primary forwarded
        self._seq = 0
        self._next_decision = 0.0
        self._show()

    @property
    def count(self) -> int:
        return len(self.addresses)

    # -- what the shard core asks (plugin.Replication) -------------------------------------------

    def raw_ops(self) -> Mapping[OpSpec, RawHandler]:
        return {COPY_STATUS: self._status, JOIN: self._join, REPLICATE: self._replicate}

    def check_serving(self, spec: OpSpec) -> None:
        """Raise NotPrimary unless this copy serves clients (promoting it if its primary is gone)."""
        if self.role == PRIMARY or self._forwarded:
            return
        if self.role == BACKUP and self._primary_gone():
            self._promote(reason="primary_unreachable")
            return
        raise errors.NotPrimary(f"copy {self.rank} of shard {self.shard.index} is {self.role}, not the primary")

    def replicate(self, incoming: interface.Incoming) -> None:
        """Forward a command just applied to every backup; return once each acked or was dropped.
        NotPrimary if a backup knows a newer primary: the client must not take this reply."""
        for rank, link in list(self.chain.items()):
            if link.broke():  # since the last forward: the copy died (or will catch up again)
                self._drop(rank, "disconnected")
        if self.role != PRIMARY or not self.chain:
            return
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        head = Header(op=REPLICATE.code, shard=self.shard.index, layout=self.shard.layout.hash, seq=self._seq,
                      step=self.shard.step).pack()
        envelope = json.dumps({"view": self.view, "user": incoming.user, "peer": incoming.peer.hex()}).encode()
        frames = [head, envelope, *incoming.frames]
        for link in self.chain.values():
            link.send(frames)
        self._collect_acks(dict(self.chain))

    def tick(self) -> None:
        """Act on what the watch saw: catch up, lead, or step down."""
        now = time.monotonic()
        if not self._started:
            self._started = True
            self.watch.start()
        if now < self._next_decision:
            return
        self._next_decision = now + DECIDE_SECONDS
        newest = self._newest_primary()
        if newest is not None and newest[1] > self.view and self.role != SYNCING:
            self._become_syncing(f"copy {newest[0]} is primary of newer view {newest[1]}")
        elif self.role == BACKUP and self._primary_moved_on():
            self._become_syncing("the primary moved to another view")
        elif self.role == SYNCING and newest is not None:
            self._catch_up(newest[0])
        elif self.role == SYNCING and self._may_lead():
            self._promote(reason="no_primary")

    def close(self) -> None:
        self.watch.close()
        for link in self.chain.values():
            link.close()

    def stats(self) -> dict:
        return {"copy": self.rank, "role": self.role, "view": self.view, "failovers": self.failovers,
                "copies": 1 + len(self.chain) if self.role == PRIMARY else 0}

    # -- decisions -------------------------------------------------------------------------------

    def _newest_primary(self) -> tuple[int, int] | None:
        """(rank, view) of the copy heard lately as primary of the newest view, if any."""
        heard = [(rank, state.view) for rank in range(self.count) if rank != self.rank
                 and (state := self.watch.heard_from(rank, PROMOTE_AFTER_SECONDS)) and state.role == PRIMARY]
        return max(heard, key=lambda rv: rv[1], default=None)

    def _primary_moved_on(self) -> bool:
        state = self.watch.heard_from(self.view % self.count, PROMOTE_AFTER_SECONDS)
        return state is not None and state.role == PRIMARY and state.view != self.view

    def _primary_gone(self) -> bool:
        """The primary of this view has not answered lately, or answers that it is not it any
        more; and no backup of this view that comes before this one in rank order is alive."""
        primary = self.view % self.count
        state = self.watch.heard_from(primary, PROMOTE_AFTER_SECONDS)
        if state is not None and (state.role == PRIMARY or state.view > self.view):
            return False
        if self.watch.started > time.monotonic() - PROMOTE_AFTER_SECONDS:
            return False  # the watch has not had the time to hear from it
        for rank in ((primary + i) % self.count for i in range(1, self.count)):
            if rank == self.rank:
                return True
            ahead = self.watch.heard_from(rank, PROMOTE_AFTER_SECONDS)
            if ahead is not None and ahead.role == BACKUP and ahead.view == self.view:
                return False
        return True

    def _may_lead(self) -> bool:
        """No copy is primary or backup: lead if this copy has the newest state (then the lowest
        rank) of those that answer, once all answer or the grace is over."""
        others = [self.watch.heard_from(r, PROMOTE_AFTER_SECONDS) for r in range(self.count) if r != self.rank]
        if any(s is not None and s.role != SYNCING for s in others):
            return False
        waited = time.monotonic() - self.watch.started
        if waited < PROMOTE_AFTER_SECONDS or (None in others and waited < STARTUP_GRACE_SECONDS):
            return False
        ranks = [r for r in range(self.count) if r != self.rank]
        best = max([(self.shard.step, -self.rank)] + [(s.step, -r) for r, s in zip(ranks, others) if s is not None])
        return best == (self.shard.step, -self.rank)

    def _promote(self, *, reason: str) -> None:
        seen = [s.view for r in range(self.count) if (s := self.watch.latest.get(r)) is not None]
        self.view = _next_view(max([self.view, *seen]), self.rank, self.count)
        if self.role == BACKUP:
            self.failovers += 1
        self.role = PRIMARY
        log.warning("event=copy_promoted shard=%d copy=%d view=%d step=%d reason=%s failovers=%d", self.shard.index,
                    self.rank, self.view, self.shard.step, reason, self.failovers)
        self._show()

    def _become_syncing(self, why: str) -> None:
        log.warning("event=copy_behind shard=%d copy=%d role=%s view=%d reason=%r", self.shard.index, self.rank,
                    self.role, self.view, why)
        for link in self.chain.values():
            link.close()
        self.chain.clear()
        self.role = SYNCING
        self._show()

    # -- the primary's side --------------------------------------------------------------------

    def _collect_acks(self, pending: dict[int, interface.Link]) -> None:
        deadline = time.monotonic() + FORWARD_SECONDS
        while pending and time.monotonic() < deadline:
            ready = self._transport.wait(list(pending.values()), 0.05)
            for rank, link in list(pending.items()):
                if link.readable(ready):
                    if self._acked(rank, link.receive()):
                        del pending[rank]
                elif link.broke(ready):
                    del pending[rank]
                    self._drop(rank, "disconnected")
        for rank in pending:
            self._drop(rank, "silent")

    def _acked(self, rank: int, received: interface.Received) -> bool:
        """False for a late answer to an earlier forward; True once this forward is settled."""
        header = protocol.unpack_header(received.header)
        if header.seq != self._seq:
            return False
        try:
            answer = _fields(received.frames[0]) if header.status == protocol.Status.OK else {}
        except (errors.ProtocolError, IndexError):
            answer = {}  # garbled: dropped below, as a refusal
        if answer.get("applied") and header.step == self.shard.step:
            return True
        if answer.get("view", 0) > self.view:
            self._become_syncing(f"copy {rank} is in newer view {answer['view']}")
            raise errors.NotPrimary(f"copy {self.rank} of shard {self.shard.index} is no longer the primary")
        self._drop(rank, "refused" if not answer.get("applied") else f"diverged: step {header.step}")
        return True

    def _drop(self, rank: int, why: str) -> None:
        link = self.chain.pop(rank)
        link.close()
        self.view += self.count  # the next view of this primary: the dropped copy learns it is behind
        log.warning("event=backup_dropped shard=%d copy=%d backup=%d reason=%r view=%d", self.shard.index, self.rank,
                    rank, why, self.view)
        self._show()

    def _join(self, header: Header, incoming: interface.Incoming) -> list:
        """A copy catches up: this primary's whole state now, every command from the next on."""
        if self.role != PRIMARY:
            raise errors.NotPrimary(f"copy {self.rank} of shard {self.shard.index} is {self.role}, not the primary")
        message = protocol.parse_request(incoming.frames, header)
        rank = _checked(message.meta.value).get("rank", -1)
        if not 0 <= rank < self.count or rank == self.rank:
            raise errors.ProtocolError(f"JOIN from copy {rank} of a shard with {self.count} copies")
        state = {"view": self.view, "failovers": self.failovers, "commands": self.shard.last_commands.export()}
        blob = b"".join(checkpoint.encode(self.shard.snapshot(transfer=True)))
        old = self.chain.pop(rank, None)
        if old is not None:
            old.close()
        self.chain[rank] = self._transport.link(self.addresses[rank], self.security)
        log.info("event=backup_joined shard=%d copy=%d backup=%d step=%d view=%d", self.shard.index, self.rank, rank,
                 self.shard.step, self.view)
        self._show()
        return [header.reply(step=self.shard.step).pack(), json.dumps(state).encode(), blob]

    # -- a backup's side -----------------------------------------------------------------------

    def _replicate(self, header: Header, incoming: interface.Incoming) -> list:
        if len(incoming.frames) < 3:
            raise errors.ProtocolError("REPLICATE carries its envelope and a request")
        envelope = _fields(incoming.frames[1])
        view = envelope.get("view", -1)
        if not isinstance(envelope.get("peer"), str) or not isinstance(envelope.get("user"), str | None) or view < 0:
            raise errors.ProtocolError("REPLICATE's envelope names no view or sender")
        if self.role != BACKUP or not (view == self.view or (view > self.view and view % self.count ==
                                                              self.view % self.count)):
            return self._replicated(header, applied=False)
        self.view = view  # the same primary, which dropped another backup
        inner = protocol.unpack_header(incoming.frames[2])
        if inner.op in self.shard.raw_ops:
            raise errors.ProtocolError(f"REPLICATE of {protocol.spec_of(inner.op).name}: only client ops are")
        try:
            peer = bytes.fromhex(envelope["peer"])
        except ValueError as exc:
            raise errors.ProtocolError(f"REPLICATE's sender is not hex: {exc}") from exc
        sender = interface.Incoming(peer=peer, user=envelope.get("user"),
                                    frames=incoming.frames[2:])
        self._forwarded = True
        try:
            reply = self.shard.answer(inner, sender)
        finally:
            self._forwarded = False
        applied = protocol.unpack_header(reply[0]).status != protocol.Status.ERROR
        return self._replicated(header, applied=applied)

    def _replicated(self, header: Header, *, applied: bool) -> list:
        answer = JsonObject({"applied": applied, "view": self.view})
        return protocol.reply_frames(header, step=self.shard.step, meta=answer)

    def _catch_up(self, primary: int) -> None:
        """JOIN the primary: take its whole state; from then on it forwards every command here."""
        link = self._transport.link(self.addresses[primary], self.security, watch=False)
        request = [Header(op=JOIN.code, shard=self.shard.index, layout=self.shard.layout.hash).pack(),
                   JsonObject({"rank": self.rank}).pack()]
        received: list[interface.Received] = []
        policy = fanout.RetryPolicy(attempt=JOIN_SECONDS, give_up=JOIN_SECONDS, resend_on_disconnect=False)
        ex = fanout.Exchange([link], [request], policy, [f"copy {primary} of shard {self.shard.index}"])
        try:
            fanout.exchange(self._transport, ex, accept=lambda i, r: bool(received.append(r)) or True,
                               stop=self.shard.stopping)
        except (errors.ShardUnavailable, errors.Stopped) as exc:
            log.warning("event=catch_up_failed shard=%d copy=%d from=%d error=%r", self.shard.index, self.rank,
                        primary, str(exc))
            return
        finally:
            link.close()
        self._install(primary, received[0])

    def _install(self, primary: int, received: interface.Received) -> None:
        header = protocol.unpack_header(received.header)
        if header.status != protocol.Status.OK or len(received.frames) != 2:
            log.info("event=catch_up_refused shard=%d copy=%d from=%d", self.shard.index, self.rank, primary)
            return
        if len(received.frames[0]) > MAX_STATE_JSON:
            raise errors.ProtocolError(f"copy {primary} sent {len(received.frames[0])} bytes of state metadata")
        state = json.loads(bytes(received.frames[0]))
        ckpt = checkpoint.decode(received.frames[1], f"the state of copy {primary} of shard {self.shard.index}")
        if ckpt.layout != self.shard.layout.hash or ckpt.shard != self.shard.index:
            raise errors.ConfigError(f"copy {primary} holds another shard or layout than copy {self.rank}")
        self.shard.load(ckpt)
        self.shard.take_meta(ckpt.meta)
        self.shard.last_commands.load(state["commands"])
        self.view, self.failovers, self.role = int(state["view"]), int(state["failovers"]), BACKUP
        log.info("event=caught_up shard=%d copy=%d from=%d step=%d view=%d", self.shard.index, self.rank, primary,
                 self.shard.step, self.view)
        self._show()

    # -- every copy ------------------------------------------------------------------------------

    def _status(self, header: Header, incoming: interface.Incoming) -> list:
        value = {"role": self.role, "view": self.view, "step": self.shard.step, "copy": self.rank}
        return protocol.reply_frames(header, step=self.shard.step, meta=JsonObject(value))

    def _show(self) -> None:
        metrics = self.shard.metrics
        metrics.copy_role.set(ROLES[self.role])
        metrics.copy_view.set(self.view)
        metrics.copies_in_sync.set(1 + len(self.chain) if self.role == PRIMARY else 0)
        metrics.failovers.set(self.failovers)


def _fields(frame: bytes | memoryview) -> dict:
    """A copy's small JSON payload, checked (ProtocolError otherwise)."""
    return _checked(JsonObject.unpack(frame).value)


def _checked(value: dict) -> dict:
    if not all(isinstance(v, int) for k, v in value.items() if k in ("view", "rank")):
        raise errors.ProtocolError(f"a copy's payload with a non-integer view or rank: {str(value)[:200]}")
    return value


def _next_view(after: int, rank: int, copies: int) -> int:
    """The smallest view above `after` whose primary is `rank`."""
    view = after + 1
    return view + (rank - view) % copies
