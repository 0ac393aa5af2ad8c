"""The updates a shard lost, as its replicas' pushes reveal them.

A replica pushes with the step it pulled from this shard (Header.step), and the shard's
step counts the updates it applied. A push pulled at step P that reaches the shard at step
S < P means the shard once held P updates and holds S now: it came back from a checkpoint,
or a copy took over, behind what it had served, and P - S applied updates are gone
(acknowledged ones among them; the replies of the last few may never have left). Within
one life of the state (from a restore, a rollback or a takeover to the next) the largest
such gap is that life's loss; the losses of the lives add up. It is a lower bound: the
updates applied after the last pull any replica made are not seen.
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger(__name__)

# The checkpoint metadata (and STATS figure) that carries the count.
KEY = "updatesLost"


class Gauge(Protocol):
    def set(self, value: float) -> None: ...


class LostUpdates:
    def __init__(self, shard: int, gauge: Gauge | None = None) -> None:
        self.shard, self.gauge = shard, gauge
        self.total = 0
        self._earlier = 0   # the lives before this one
        self._now = 0       # the largest gap seen in this life

    def new_life(self) -> None:
        """The shard's state was replaced (restored, rolled back, taken over)."""
        self._earlier, self._now = self.total, 0

    def restore(self, total: int) -> None:
        """The count a checkpoint kept, in a new life."""
        self.total = self._earlier = total
        self._now = 0
        self._show()

    def seen(self, pulled: int, step: int) -> bool:
        """A push pulled at `pulled` reached the shard at `step`: whether the count grew."""
        gap = pulled - step
        if gap <= self._now:
            return False
        self._now = gap
        self.total = self._earlier + gap
        log.warning("event=updates_lost shard=%d step=%d pulled_at=%d lost=%d", self.shard, step, pulled, self.total)
        self._show()
        return True

    def _show(self) -> None:
        if self.gauge is not None:
            self.gauge.set(self.total)
