"""Copies of one shard (spec.parameterServers.backups): a primary and its backups, whose
view is kept in a linearizable store (viewstore.py) and changed only by compare-and-swap.

The view record names the view (a number), its primary and the in-sync set: the copies
(rank and incarnation) that hold every update acknowledged in this view. Every copy runs
the same core and plugins; only the primary serves clients.

- Primary. It forwards each command it applies to every copy it streams to (REPLICATE,
  forwarding.py) and serves on; a reply leaves (Replication.released) once every installed
  copy acknowledged it, while its lease holds and its in-sync set has minInSync copies
  (keeper.py renews it in a thread). A dead copy (its link broke, the heartbeat timed out)
  or a slow one (FORWARD_SECONDS) leaves the in-sync set by a compare-and-swap, and only
  then is its acknowledgement no longer waited for. A copy joins the set once it installed
  the whole state (transfer.py) and acknowledged every command whose reply left. A primary
  whose lease is another's, or whose forward a copy of a newer view refuses, steps down;
  the replies it held are dropped (the new primary's resend record answers their clients).
- Backup. It applies the primary's messages in their order (a gap, another view or
  another stream is refused: the view fences an old primary off). When the lease of its
  view has not been renewed for its length by this copy's own clock, a backup of the
  in-sync set takes over with one compare-and-swap naming the version it saw: it then holds
  every acknowledged update. The backup furthest along takes over (the others wait for it a
  moment), and its in-sync set keeps the other live backups of the old one that stand where
  it stands or a few commands behind: it resumes them (forwarding.Chain.resume) with the
  commands they lack before it answers anyone, and one that does not stand where it said is
  taken out of the set first. A backup taken out of the set, or of a newer view whose set
  does not name it, catches up.
- Catching up (SYNCING). It asks the primary of the record to JOIN and receives its state in
  parts while applying the commands that go on (transfer.py). With no live primary and no
  live copy of the in-sync set (a job starting or resuming), the copy with the newest state
  (then the lowest rank) of those that answer takes the view, once all answered or
  STARTUP_GRACE_SECONDS passed. A view claimed is above any view known (epoch.py).

A copy takes a new incarnation (a random name) whenever it starts catching up, so that a
copy that restarted or lost its place never passes for one the in-sync set names.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Mapping, Sequence

from distbelief.runtime import errors
from distbelief.runtime.shard.copies.following import JOIN, Follower
from distbelief.runtime.shard.copies import epoch, forwarding
from distbelief.runtime.shard.copies.forwarding import REPLICATE, Chain, Position
from distbelief.runtime.shard.copies.keeper import Keeper, Seen
from distbelief.runtime.shard.copies.transfer import COPY_STATE, MAX_ARRAYS, PART_BYTES, Sender
from distbelief.runtime.shard.copies.viewstore import Member, ViewRecord, ViewStore
from distbelief.runtime.shard.copies.watch import BACKUP, COPY_STATUS, PRIMARY, SYNCING, Watch
from distbelief.runtime.shard.core import Shard
from distbelief.runtime.shard.plugin import RawHandler
from distbelief.runtime.transport import interface, zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Header, JsonObject, OpSpec

log = logging.getLogger(__name__)

LEASE_SECONDS = 3.0           # a primary's lease; a backup takes over once it went this long unrenewed
ALIVE_SECONDS = 1.0           # a copy that answered COPY_STATUS this recently is alive
STARTUP_GRACE_SECONDS = 30.0  # with no primary, wait this long for silent copies before leading
DEFER_SECONDS = 1.0           # after the lease expired, a backup waits this long for one further along to take over
DECIDE_SECONDS = 0.1          # how often the serving loop decides from what the keeper and watch saw
TRANSFER_SILENT_SECONDS = 10.0  # a transfer that heard nothing this long broke off
ADD_WAIT_SECONDS = 15.0       # an installed copy the primary did not add to the in-sync set catches up again

ROLES = {SYNCING: 0, BACKUP: 1, PRIMARY: 2}


class Copies:
    """This copy of a shard, among addresses (how it reaches every copy, by rank). The role
    hands it to the shard's core (Shard.serve_copies), which asks it what plugin.Replication says."""

    extra_frames = MAX_ARRAYS     # a part: its header, its envelope, its arrays
    frame_bytes = 2 * PART_BYTES  # a part's array, or the begin's record of last commands

    def __init__(self, shard: Shard, *, rank: int, addresses: Sequence[str], security: dict | None,
                 store: ViewStore, transport_: interface.Transport | None = None,
                 lease_seconds: float = LEASE_SECONDS, min_in_sync: int = 1) -> None:
        if not 0 <= rank < len(addresses) or not 1 <= min_in_sync <= len(addresses):
            raise errors.ConfigError(f"copy {rank} of shard {shard.index}, which has {len(addresses)} copies, "
                                     f"{min_in_sync} of them in sync before an update is acknowledged")
        self.shard, self.rank, self.addresses, self.security = shard, rank, list(addresses), security
        self.lease_seconds = lease_seconds
        self._transport = transport_ or zmq_transport.default()
        self.incarnation = secrets.token_hex(6)
        self.role, self.view, self.term = SYNCING, 0, 0
        self.epoch = epoch.ViewEpoch(shard.settings.checkpoint_dir)
        self.chain: Chain | None = None
        self.keeper = Keeper(store, shard=shard.index, rank=rank, lease_seconds=lease_seconds, min_in_sync=min_in_sync,
                             save=shard.checkpoint_now)
        self.watch = Watch(shard=shard.index, layout=shard.layout.hash, security=security, transport_=self._transport,
                           addresses={r: a for r, a in enumerate(addresses) if r != rank})
        self.follower = Follower(self, shard, rank=rank, addresses=self.addresses, security=security,
                                 transport_=self._transport)
        self._started = False
        self.forwarded = False     # applying a request the primary forwarded
        self._installed_at, self._member_seen = 0.0, False
        self._claiming = False
        self._released = 0         # as primary: the highest command whose reply left
        self._keeping: dict[Member, Position] = {}  # claiming: the other copies kept in sync, where they stand
        self._removing: dict[tuple[int, str], int | None] = {}  # member -> the generation without it
        self._failovers = 0
        self._next_decision = 0.0
        self._show()

    @property
    def count(self) -> int:
        return len(self.addresses)

    # -- what the shard core asks (plugin.Replication) -------------------------------------------

    def raw_ops(self) -> Mapping[OpSpec, RawHandler]:
        return {COPY_STATUS: self._status, JOIN: self._join, REPLICATE: self.follower.replicate,
                COPY_STATE: self.follower.copy_state}

    def serves_clients(self) -> bool:
        return self.role == PRIMARY and not self.forwarded

    def check_serving(self, spec: OpSpec) -> None:
        if self.role != PRIMARY and not self.forwarded:
            raise errors.NotPrimary(f"copy {self.rank} of shard {self.shard.index} is {self.role}, not the primary")

    def replicate(self, incoming: interface.Incoming) -> None:
        if self.role == PRIMARY and self.chain is not None:
            self.chain.forward(incoming, step=self.shard.step, taken_at=self.shard.command_time)

    def reply_tag(self) -> Any:
        return (self.term, self.chain.seq) if self.role == PRIMARY and self.chain is not None else None

    def released(self, tag: Any) -> bool | None:
        term, seq = tag
        if term != self.term or self.chain is None:
            return None
        if not self.keeper.may_acknowledge() or not self.chain.settled(seq):
            return False
        self._released = max(self._released, seq)
        return True

    def links(self) -> Sequence[interface.Link]:
        return self.chain.links() if self.chain is not None else ()

    def accepting(self) -> bool:
        return self.chain is None or not self.chain.full()

    def tick(self) -> None:
        """Read the copies' answers, send parts of the state, and act on what the keeper saw."""
        now = time.monotonic()
        if not self._started:
            self._started = True
            self.keeper.start()
            self.watch.start()
        self.keeper.serving()
        if self.chain is not None:
            try:
                self.chain.pump()
            except errors.NotPrimary as exc:
                self._catch_up_again(str(exc))
            else:
                self.chain.send_parts(self.shard.step, forwarding.PARTS_WINDOW_BYTES)
        self.follower.read_join_answers()
        if self._claiming:
            outcome = self.keeper.claim_outcome()
            if outcome is not None:
                self._claiming = False
                if isinstance(outcome, ViewRecord):
                    self._promote(outcome)
        if now < self._next_decision:
            return
        self._next_decision = now + DECIDE_SECONDS
        seen = self.keeper.observed()
        if self.role == PRIMARY:
            self._lead(seen)
        elif self.role == BACKUP:
            self._follow(seen, now)
        else:
            self._sync(seen, now)

    def close(self) -> None:
        self.watch.close()
        if self.chain is not None:
            self.chain.close_all()
        self.follower.drop()
        self.keeper.close(release=self.role == PRIMARY)

    def stats(self) -> dict:
        holding = self.keeper.holding()
        copies = len(holding.in_sync) if self.role == PRIMARY and holding is not None else 0
        return {"copy": self.rank, "role": self.role, "view": self.view, "failovers": self._failovers, "copies": copies}

    # -- decisions -------------------------------------------------------------------------------

    def _lead(self, seen: Seen) -> None:
        record = seen.record
        if self.keeper.lost or record is None or record.view != self.view or record.holder != self.incarnation:
            self._catch_up_again("the view's lease is no longer this copy's")
            return
        assert self.chain is not None
        self._failovers = record.failovers
        for stream in list(self.chain.streams.values()):
            if stream.failure is None:
                continue
            if stream.installed and stream.member not in self._removing:
                log.warning("event=backup_leaving shard=%d copy=%d backup=%d reason=%r view=%d", self.shard.index,
                            self.rank, stream.rank, stream.failure, self.view)
                self._removing[stream.member] = None
            elif not stream.installed:
                log.info("event=catch_up_dropped shard=%d copy=%d to=%d reason=%r", self.shard.index, self.rank,
                         stream.rank, stream.failure)
                self.chain.close(stream)
        members = [(self.rank, self.incarnation)] + [
            s.member for s in self.chain.installed() if s.member not in self._removing and s.acked_seq >= self._released]
        generation = self.keeper.want_in_sync(tuple(members))
        confirmed = self.keeper.confirmed_generation()
        for member, wanted in list(self._removing.items()):
            if wanted is None:
                self._removing[member] = wanted = generation
            if confirmed >= wanted:  # written without it: its acknowledgements are no longer waited for
                del self._removing[member]
                stream = self.chain.streams.get(member)
                if stream is not None:
                    self.chain.close(stream)
                log.warning("event=backup_dropped shard=%d copy=%d backup=%d view=%d", self.shard.index, self.rank,
                            member[0], self.view)
        self.keeper.may_acknowledge()  # a set fallen short of minInSync saves now, not at its next reply
        self._show()

    def _follow(self, seen: Seen, now: float) -> None:
        record = seen.record
        if record is None:
            self._catch_up_again("no view record")
            return
        if record.view < self.view:
            return  # read before this copy resumed under the new view's primary
        member = record.member(self.rank, self.incarnation)
        if record.view > self.view and not member:
            self._catch_up_again("a newer view")
            return
        if member:
            self._member_seen = True
        elif self._member_seen:
            self._catch_up_again("taken out of the in-sync set")
            return
        elif now - self._installed_at > ADD_WAIT_SECONDS:
            self._catch_up_again("not added to the in-sync set")
            return
        self._failovers = record.failovers
        if member and seen.expired(now) and not self._claiming and (
                self._foremost(record) or now - seen.since - record.lease_seconds >= DEFER_SECONDS):
            self._claim(seen, record.view + 1, failovers=record.failovers + 1, reason="primary_lease_expired",
                        keeping=self._in_step(record))

    def _backups_of(self, record: ViewRecord) -> dict[Member, Position | None]:
        """The other copies of record's in-sync set alive as its backups, and where each stands."""
        backups = {}
        for rank, incarnation in record.in_sync:
            state = self.watch.heard_from(rank, ALIVE_SECONDS)
            if rank != self.rank and state is not None and state.incarnation == incarnation and state.role == BACKUP:
                backups[(rank, incarnation)] = state.position
        return backups

    def _foremost(self, record: ViewRecord) -> bool:
        """Whether no other live backup of record's in-sync set stands further along (or as
        far, with a lower rank): the one furthest along takes over and keeps the others."""
        mine = (self.follower.position or (-1, -1), -self.rank)
        return all((position or (-1, -1), -rank) < mine for (rank, _), position in self._backups_of(record).items())

    def _in_step(self, record: ViewRecord) -> dict[Member, Position]:
        """The live backups of record's in-sync set that stand where this copy stands, or a
        few commands behind (it knows those commands): they stay in sync under it."""
        return {member: position for member, position in self._backups_of(record).items()
                if position is not None and self.follower.since(position) is not None}

    def _sync(self, seen: Seen, now: float) -> None:
        record, receiver = seen.record, self.follower.receiver
        if receiver is not None:
            if record is None or record.view != receiver.view:
                self.follower.abort("its primary is gone")
            elif now - self.follower.heard > TRANSFER_SILENT_SECONDS:
                self.follower.abort(f"silent for {now - self.follower.heard:.0f} s")
            return
        if record is not None and not seen.expired(now):
            if record.primary != self.rank:
                self.follower.ask_to_join(record, now)
            return
        if self._claiming or not self._may_lead(record, seen, now):
            return
        self._claim(seen, (record.view if record else 0) + 1, failovers=record.failovers if record else 0,
                    reason="no_primary", keeping={})

    def _may_lead(self, record: ViewRecord | None, seen: Seen, now: float) -> bool:
        """No live lease: lead if no copy of the in-sync set is alive (it takes over) and this
        copy has the newest whole state (then the lowest rank) of those that answer, once all
        answer or the grace is over."""
        others = {r: self.watch.heard_from(r, ALIVE_SECONDS) for r in range(self.count) if r != self.rank}
        if record is not None and any(s is not None and record.member(r, s.incarnation) for r, s in others.items()):
            return False
        if not self.follower.sound or now - self.watch.started < ALIVE_SECONDS:
            return False
        expired_at = seen.since + record.lease_seconds if record is not None else self.watch.started
        if None in others.values() and now - max(self.watch.started, expired_at) < STARTUP_GRACE_SECONDS:
            return False
        heard = [(s.step, -r) for r, s in others.items() if s is not None and s.role == SYNCING]
        return max([(self.shard.step, -self.rank), *heard]) == (self.shard.step, -self.rank)

    def _claim(self, seen: Seen, view: int, *, failovers: int, reason: str, keeping: dict[Member, Position]) -> None:
        view = max(view, self.view + 1, self.epoch.highest + 1, *(p.view + 1 for p in list(self.watch.latest.values())))
        record = ViewRecord(view=view, primary=self.rank, in_sync=((self.rank, self.incarnation), *sorted(keeping)),
                            holder=self.incarnation, renewed=time.time(), lease_seconds=self.lease_seconds,
                            failovers=failovers)
        log.info("event=view_claimed shard=%d copy=%d view=%d reason=%s position=%s keeping=%s", self.shard.index,
                 self.rank, view, reason, self.follower.position, sorted(rank for rank, _ in keeping))
        self._claiming, self._keeping = True, keeping
        self.keeper.claim(seen.version, record)

    def _promote(self, record: ViewRecord) -> None:
        was, position = self.role, self.follower.position
        self.role, self.view, self.term = PRIMARY, record.view, self.term + 1
        self._failovers, self._released, self._removing = record.failovers, 0, {}
        self.chain = Chain(shard=self.shard.index, layout=self.shard.layout.hash, view=self.view,
                           transport_=self._transport, security=self.security)
        for rank, incarnation in record.in_sync[1:]:  # before any request: their acknowledgements are waited for
            since = self._keeping[(rank, incarnation)]
            self.chain.resume(rank, incarnation, self.addresses[rank], since=since, commands=self.follower.since(since))
        self.follower.drop()
        self.shard.lost.new_life(self.shard.step)   # what the replicas pulled from the old primary is measured against this copy
        log.warning("event=copy_promoted shard=%d copy=%d view=%d step=%d was=%s failovers=%d position=%s "
                    "keeping=%s", self.shard.index, self.rank, self.view, self.shard.step, was, self._failovers,
                    position, [rank for rank, _ in record.in_sync[1:]])
        self._show()

    def _catch_up_again(self, why: str) -> None:
        log.warning("event=copy_behind shard=%d copy=%d role=%s view=%d reason=%r", self.shard.index, self.rank,
                    self.role, self.view, why)
        if self.chain is not None:
            self.chain.close_all()
            self.chain = None
        if self.role == PRIMARY:
            self.keeper.resign()
        self.follower.abort(why)
        self.role, self.term = SYNCING, self.term + 1
        self.incarnation = secrets.token_hex(6)  # what the in-sync set named is not this copy any more
        self._member_seen = False
        self._show()

    def resumed(self, view: int) -> None:
        """The primary of a newer view took over with this copy in its in-sync set."""
        self.view = view
        log.info("event=copy_resumed shard=%d copy=%d view=%d step=%d", self.shard.index, self.rank, view, self.shard.step)
        self._show()

    def installed(self, view: int) -> None:
        """The follower installed the primary of view's whole state: a backup now."""
        self.role, self.view = BACKUP, view
        self._installed_at, self._member_seen = time.monotonic(), False
        log.info("event=caught_up shard=%d copy=%d view=%d step=%d", self.shard.index, self.rank, view,
                 self.shard.step)
        self._show()

    # -- the primary's side --------------------------------------------------------------------

    def _join(self, header: Header, incoming: interface.Incoming) -> list:
        """A copy asks to catch up: a stream to it, its transfer begun now."""
        if self.role != PRIMARY or self.chain is None:
            raise errors.NotPrimary(f"copy {self.rank} of shard {self.shard.index} is {self.role}, not the primary")
        value = protocol.parse_request(incoming.frames, header).meta.value
        rank, incarnation, view = value.get("rank"), value.get("incarnation"), value.get("view")
        if not isinstance(rank, int) or not 0 <= rank < self.count or rank == self.rank or not isinstance(
                incarnation, str):
            raise errors.ProtocolError(f"JOIN from copy {rank!r} of a shard with {self.count} copies")
        if view != self.view:
            raise errors.NotPrimary(f"copy {self.rank} of shard {self.shard.index} is primary of view {self.view}")
        for stream in list(self.chain.streams.values()):
            if stream.rank == rank:  # its earlier life: it left that state behind
                stream.failure = stream.failure or "asked to join again"
                if not stream.installed:
                    self.chain.close(stream)
        stream = self.chain.open(rank, incarnation, self.addresses[rank], Sender(self.shard))
        log.info("event=backup_joining shard=%d copy=%d backup=%d step=%d view=%d parts=%d", self.shard.index,
                 self.rank, rank, self.shard.step, self.view, sum(int(p["parts"]) for p in stream.transfer.plans))
        return protocol.reply_frames(header, step=self.shard.step, meta=JsonObject({"stream": stream.id}))

    # -- every copy ------------------------------------------------------------------------------

    def _status(self, header: Header, incoming: interface.Incoming) -> list:
        position = self.follower.position
        value = {"role": self.role, "view": self.view, "step": self.shard.step if self.follower.sound else -1,
                 "copy": self.rank, "incarnation": self.incarnation,
                 "position": None if position is None else list(position)}
        return protocol.reply_frames(header, step=self.shard.step, meta=JsonObject(value))

    def _show(self) -> None:
        self.epoch.remember(self.view)   # after every change, as the metrics
        metrics = self.shard.metrics
        metrics.copy_role.set(ROLES[self.role])
        metrics.copy_view.set(self.view)
        holding = self.keeper.holding() if self.role == PRIMARY else None
        metrics.copies_in_sync.set(len(holding.in_sync) if holding is not None else 0)
        metrics.failovers.set(self._failovers)
