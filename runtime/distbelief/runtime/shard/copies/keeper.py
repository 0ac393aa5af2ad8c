"""A copy's thread that keeps its view in the store (viewstore.py), apart from the serving
thread: a primary's lease is renewed while the serving thread is busy (a long checkpoint, a
large request), so slow is never taken for dead.

Every `lease / RENEWALS` seconds it either
- renews, when this copy holds the record (it is primary): a compare-and-swap of the record
  it wrote last, with the in-sync set the serving thread wants now (want_in_sync). The
  lease then holds until the send time of that write plus `lease x (1 - DRIFT)` by this
  copy's clock (DRIFT: how much faster another copy's clock may run). A conflict means
  someone else wrote: if the record is no longer this copy's, the lease is lost;
- or makes the serving thread's claim (a takeover or an election): one compare-and-swap
  naming the version the claim was decided on;
  A primary whose serving loop has not turned for STUCK_SECONDS (a handler that never
  returns) stops renewing, so that a backup takes over: slow is tolerated, stuck is not;
- or reads, and notes when the version last changed by this copy's clock (observed()): a
  backup judges the primary's lease expired once the version it saw has not changed for
  the lease's length (the standard leader-election pattern: no clock is compared with
  another's).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from distbelief.runtime.shard.copies.viewstore import Member, StoreUnavailable, ViewRecord, ViewStore

log = logging.getLogger(__name__)

RENEWALS = 6      # store calls per lease length
DRIFT = 0.1       # a primary stops acknowledging this fraction of its lease early
STUCK_SECONDS = 120.0  # a primary whose serving loop has not turned this long stops renewing: it is dead
LOG_EVERY_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class Seen:
    """The newest record this copy knows, its version, and since when (monotonic)."""

    record: ViewRecord | None
    version: str
    since: float

    def expired(self, now: float) -> bool:
        """Whether the record's lease has run out by this copy's clock (or was released)."""
        return self.record is None or self.record.holder == "" or now - self.since >= self.record.lease_seconds


class Keeper:
    def __init__(self, store: ViewStore, *, shard: int, rank: int, lease_seconds: float, min_in_sync: int = 1,
                 save: Callable[[], None] = lambda: None) -> None:
        self.store, self.shard, self.rank = store, shard, rank
        self.lease_seconds, self.min_in_sync, self._save = lease_seconds, min_in_sync, save
        self._short_of_copies = False  # replies held for want of min_in_sync copies in the in-sync set
        self._lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._seen = Seen(None, "", time.monotonic())
        self._holding: ViewRecord | None = None   # the record this copy wrote last, as primary
        self._holds_until = 0.0
        self._want: tuple[Member, ...] | None = None
        self._want_generation = 0       # counts the changes of _want
        self._confirmed_generation = 0  # the generation of _want the holding record was written from
        self._claim: tuple[str, ViewRecord] | None = None
        self._outcome: ViewRecord | bool | None = None  # a claim's: the record won, False lost, None pending
        self.lost = False            # set when this copy's lease turned out to be someone else's
        self.unavailable_since: float | None = None
        self._serving_at = time.monotonic()
        self._logged = 0.0
        self._thread = threading.Thread(target=self._run, name=f"copy-keeper-{shard}", daemon=True)

    # -- what the serving thread asks ----------------------------------------------------------

    def start(self) -> None:
        self._turn_safely()  # the first observation before anyone decides
        self._thread.start()

    def observed(self) -> Seen:
        with self._lock:
            return self._seen

    def holding(self) -> ViewRecord | None:
        """The record this copy wrote last as primary (its in-sync set is the confirmed one)."""
        with self._lock:
            return self._holding

    def serving(self) -> None:
        """The serving loop turned (called at every turn)."""
        self._serving_at = time.monotonic()

    def lease_valid(self) -> bool:
        with self._lock:
            return self._holding is not None and time.monotonic() < self._holds_until

    def may_acknowledge(self) -> bool:
        """Whether a reply may leave: the lease holds and the confirmed in-sync set has
        min_in_sync copies (spec.parameterServers.minInSync). With fewer, the primary applies
        on and its replies wait until a copy catches up and joins the set; and before it goes
        on, it saves a checkpoint, so that what it acknowledged survives its own death too
        while no other copy holds it."""
        with self._lock:
            count = len(self._holding.in_sync) if self._holding is not None else 0
        if (count < self.min_in_sync) != self._short_of_copies:
            self._short_of_copies = count < self.min_in_sync
            log.warning("event=acknowledgements_%s shard=%d copy=%d in_sync=%d min_in_sync=%d",
                        "held" if self._short_of_copies else "resumed", self.shard, self.rank, count, self.min_in_sync)
            if self._short_of_copies:
                self._save()
        return not self._short_of_copies and self.lease_valid()

    def claim(self, version: str, record: ViewRecord) -> None:
        """Write record if the store still holds version (the outcome: claim_outcome())."""
        with self._lock:
            self._claim, self._outcome = (version, record), None
        if self.unavailable_since is None:  # a store that is out is tried at the renewals' rate, not at every decision
            self._wake.set()

    def claim_outcome(self) -> ViewRecord | bool | None:
        with self._lock:
            outcome, self._outcome = self._outcome, None
            return outcome

    def want_in_sync(self, members: tuple[Member, ...]) -> int:
        """The in-sync set the primary's next renewal writes (itself first); the generation
        of this wish (confirmed_generation() reaches it once a write of it, or of a later
        wish, went through)."""
        with self._lock:
            changed = members != self._want
            if changed:
                self._want, self._want_generation = members, self._want_generation + 1
            generation = self._want_generation
        if changed:
            self._wake.set()
        return generation

    def confirmed_generation(self) -> int:
        with self._lock:
            return self._confirmed_generation

    def resign(self) -> None:
        """The serving thread stepped down: no more renewals."""
        with self._lock:
            self._holding, self._holds_until, self._want, self.lost = None, 0.0, None, False

    def close(self, *, release: bool) -> None:
        """Stop; with release, a primary leaves a record its backups may take over at once."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        holding = self.holding()
        if release and holding is not None:
            try:
                self.store.compare_and_swap(self.observed().version, dataclasses.replace(holding, holder=""))
            except StoreUnavailable as exc:
                log.warning("event=lease_not_released shard=%d copy=%d error=%r", self.shard, self.rank, str(exc))

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.lease_seconds / RENEWALS)
            self._wake.clear()
            if not self._stop.is_set():
                self._turn_safely()

    def _turn_safely(self) -> None:
        try:
            self._turn()
            self.unavailable_since = None
        except StoreUnavailable as exc:
            now = time.monotonic()
            self.unavailable_since = self.unavailable_since or now
            if now - self._logged >= LOG_EVERY_SECONDS:
                self._logged = now
                log.warning("event=view_store_unavailable shard=%d copy=%d store=%r error=%r", self.shard, self.rank,
                            self.store.describe(), str(exc))

    def _turn(self) -> None:
        with self._lock:
            claim, self._claim = self._claim, None
            holding, want, generation = self._holding, self._want, self._want_generation
        if claim is not None:
            self._decide_claim(*claim)
        elif holding is not None and time.monotonic() - self._serving_at > STUCK_SECONDS:
            log.error("event=lease_not_renewed shard=%d copy=%d reason=serving_loop_stuck stuck_s=%.0f", self.shard,
                      self.rank, time.monotonic() - self._serving_at)
        elif holding is not None:
            self._renew(holding, want, generation)
        else:
            self._read()

    def _decide_claim(self, version: str, record: ViewRecord) -> None:
        sent = time.monotonic()
        try:
            new = self.store.compare_and_swap(version, record)
        except StoreUnavailable:
            with self._lock:
                self._outcome = False  # unknown: the serving thread decides again from a fresh read
            raise
        with self._lock:
            if new is None:
                self._outcome = False
            else:
                self._seen = Seen(record, new, sent)
                self._holding, self._holds_until = record, sent + self.lease_seconds * (1 - DRIFT)
                self._want, self._outcome = record.in_sync, record
                self._want_generation += 1
                self._confirmed_generation = self._want_generation
        if new is None:
            self._read()

    def _renew(self, holding: ViewRecord, want: tuple[Member, ...] | None, generation: int) -> None:
        record = dataclasses.replace(holding, renewed=time.time(), in_sync=want or holding.in_sync)
        sent = time.monotonic()
        new = self.store.compare_and_swap(self.observed().version, record)
        if new is not None:
            with self._lock:
                if self._holding is not None:  # not resigned meanwhile
                    self._seen = Seen(record, new, sent)
                    self._holding, self._holds_until = record, sent + self.lease_seconds * (1 - DRIFT)
                    self._confirmed_generation = max(self._confirmed_generation, generation)
            return
        current, version = self._read()
        with self._lock:
            if current is not None and current.holder == holding.holder and current.view == holding.view:
                self._holding = current  # an earlier write of ours went through unanswered: go on from it
            elif self._holding is not None:
                self._holding, self._holds_until, self.lost = None, 0.0, True
                log.warning("event=lease_lost shard=%d copy=%d view=%d now=%s", self.shard, self.rank, holding.view,
                            None if current is None else f"view {current.view} of copy {current.primary}")

    def _read(self) -> tuple[ViewRecord | None, str]:
        record, version = self.store.read()
        now = time.monotonic()
        with self._lock:
            if version != self._seen.version:
                self._seen = Seen(record, version, now)
        return record, version
