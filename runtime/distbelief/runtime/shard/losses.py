"""The updates a shard lost, as its replicas' pushes reveal them.

A replica pushes with the step it pulled from this shard (Header.step), and the shard's
step counts the updates it applied. A life of the state begins at step B (a restore, a
rollback or a takeover) and serves steps from B up. A push pulled at step P that reaches
the shard at step S < P was pulled in an earlier life, which held P updates: the P - B
applied after B there are gone (acknowledged ones among them; the replies of the last few
may never have left), whatever this life applied since. The largest such P - B is the
life's loss; the losses of the lives add up. It is a lower bound, exact once the replica
that pulled last before the loss pushes again before this life passes that step: the
updates applied after the last pull any replica made are not seen, nor a pull this life
has already overtaken.
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
        self._began = 0     # the step this life began at

    def new_life(self, step: int) -> None:
        """The shard's state was replaced (restored, rolled back, taken over) by one at step."""
        self._earlier, self._now, self._began = self.total, 0, step

    def restore(self, total: int) -> None:
        """The count a checkpoint kept, in a new life."""
        self.total = self._earlier = total
        self._now = 0
        self._show()

    def seen(self, pulled: int, step: int) -> bool:
        """A push pulled at `pulled` reached the shard at `step`: whether the count grew."""
        if pulled <= step:
            return False  # pulled in this life, or stale
        gap = pulled - self._began
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
