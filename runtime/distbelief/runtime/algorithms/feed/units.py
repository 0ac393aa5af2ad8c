"""Which replica holds which work unit, epoch by epoch: the dispenser's bookkeeping, without
sockets or clocks of its own (both are given), so that every rule can be tested.

- Epoch e hands out every unit once, in an order drawn from (seed, e). When the last unit
  of epoch e is handed out, the units of epoch e+1 follow at once: no replica waits for
  another's last unit.
- A replica holds a unit until it reports it finished (every example of it has gone into a
  minibatch). Any request of the replica renews the lease on every unit it holds.
- A replica that leaves (scaled down, stopped) or dies keeps its units until its lease runs
  out (`lease` seconds without a request; a live replica asks at least every few seconds).
  Then each unit it held is handed out again, in the same epoch, before any other unit:
  the examples the replica had already trained on from such a unit are seen twice in that
  epoch; no example is ever skipped. A late report of a unit taken back is ignored.
- A replica that joins takes units from the same queue, so the rest rebalance by taking
  fewer; one that leaves leaves more to the others.
- The position (epoch, units finished in it and their order) is what a checkpoint records;
  `restore` resumes there: the units finished are not handed out again that epoch (a unit
  of the previous epoch still out when the position was taken is not handed out again).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass
class Held:
    worker: int
    deadline: float


class Units:
    def __init__(self, count: int, *, seed: int, lease: float) -> None:
        if count < 1:
            raise ValueError("a file set has at least one unit")
        self.count, self.seed, self.lease = count, seed, lease
        self.epoch = 0
        self.finished: dict[int, set[int]] = collections.defaultdict(set)   # epoch -> its units finished
        self.finished_total = 0
        self.handed_out = 0
        self.taken_back = 0
        self.ignored = 0
        self._queue: collections.deque[tuple[int, int]] = collections.deque(self._order(0))
        self._again: collections.deque[tuple[int, int]] = collections.deque()  # taken back: first out
        self._held: dict[tuple[int, int], Held] = {}

    def _order(self, epoch: int) -> list[tuple[int, int]]:
        return [(epoch, int(u)) for u in np.random.default_rng([self.seed, epoch]).permutation(self.count)]

    @property
    def epochs(self) -> float:
        """Epochs finished: units finished over units per epoch (2.5: two and a half)."""
        return self.finished_total / self.count

    def renew(self, worker: int, now: float) -> None:
        for held in self._held.values():
            if held.worker == worker:
                held.deadline = now + self.lease

    def expire(self, now: float) -> None:
        """Take back every unit whose holder has not asked within its lease."""
        for key, held in list(self._held.items()):
            if held.deadline <= now:
                self._take_back(key)

    def _take_back(self, key: tuple[int, int]) -> None:
        del self._held[key]
        self._again.append(key)
        self.taken_back += 1

    def finish(self, worker: int, epoch: int, unit: int) -> bool:
        """The replica finished the unit; False (ignored) unless it holds it."""
        held = self._held.get((epoch, unit))
        if held is None or held.worker != worker:
            self.ignored += 1
            return False
        del self._held[(epoch, unit)]
        self.finished[epoch].add(unit)
        self.finished.pop(epoch - 2, None)  # an epoch two back has nothing in flight worth keeping
        self.finished_total += 1
        return True

    def hand_out(self, worker: int, now: float) -> tuple[int, int]:
        """(epoch, unit) for the replica: a unit taken back first, else the epoch's next; once
        every unit of the epoch is out, the next epoch's first."""
        if not self._again and not self._queue:
            self.epoch += 1
            self._queue.extend(self._order(self.epoch))
        source = self._again or self._queue
        key = source.popleft()
        self._held[key] = Held(worker, now + self.lease)
        self.handed_out += 1
        return key

    def held_by(self, worker: int) -> list[tuple[int, int]]:
        return [key for key, held in self._held.items() if held.worker == worker]

    # -- the position a checkpoint records ---------------------------------------------------

    def position(self) -> dict:
        """Where the data stands: the current epoch and the units of it not to hand out again."""
        return {"epoch": self.epoch, "finished": sorted(self.finished[self.epoch]),
                "finishedTotal": self.finished_total}

    def restore(self, position: dict) -> None:
        """Resume at a recorded position: its epoch, without the units finished in it."""
        self.epoch = int(position["epoch"])
        done = {int(u) for u in position.get("finished", [])}
        self._queue = collections.deque(k for k in self._order(self.epoch) if k[1] not in done)
        self._again.clear()
        self._held.clear()
        self.finished_total = int(position.get("finishedTotal", self.epoch * self.count + len(done)))
        self.finished = collections.defaultdict(set, {self.epoch: done})
