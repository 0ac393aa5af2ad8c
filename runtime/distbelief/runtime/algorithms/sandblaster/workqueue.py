"""The coordinator's bookkeeping of one evaluation's work units, with backup tasks.

A batch of `total` examples is cut into units of `unit_size`. Units go out in order to
replicas as they ask. Once every unit is out, a replica that asks again gets a copy of an
unfinished unit it does not hold (the one with the fewest copies, oldest first): a backup
task, but only of a straggler, a unit out for longer than BACKUP_AFTER times the median
time the units done in this evaluation took. Without that, every replica idle at an
evaluation's tail would take a copy of a unit handed out a moment before: at 256 replicas
that was 28 % of the units handed out (docs/scale.md). Before any unit is done there is no
straggler: units held by replicas that all died go out again after `reissue_after`. The
first result for a unit counts; later ones are dropped. A unit whose every copy
has been out longer than `reissue_after` seconds may go out again even with backups off,
so a replica that died holding units never stalls the evaluation.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Hashable
from collections import deque

import numpy as np

from distbelief.runtime.algorithms.sandblaster.ops import WorkUnit

BACKUP_AFTER = 2.0


@dataclasses.dataclass
class _Outstanding:
    holders: set[Hashable]
    issued_at: float   # its latest copy
    first_issued_at: float


@dataclasses.dataclass
class QueueStats:
    issued: int = 0
    backups: int = 0          # copies handed out while the first was still unfinished
    duplicates: int = 0       # results that arrived for a unit already done


class WorkQueue:
    def __init__(self, total: int, unit_size: int, *, backups: bool = True, reissue_after: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if total <= 0 or unit_size <= 0:
            raise ValueError("a batch needs examples and a unit size")
        self.total, self.unit_size = total, unit_size
        self.units = -(-total // unit_size)
        self.backups, self.reissue_after, self.clock = backups, reissue_after, clock
        self.stats = QueueStats()
        self.evaluation = 0
        self._pending: deque[int] = deque()
        self._outstanding: dict[int, _Outstanding] = {}
        self._done: set[int] = set()
        self._handed: dict[int, set[Hashable]] = {}  # unit -> every replica it went to, this evaluation
        self._took: list[float] = []  # seconds from its first copy to its result, per unit done this evaluation
        self._straggling = (0, 0.0)   # (units done, the threshold they give)
        self.objective = 0.0

    def begin(self, evaluation: int) -> None:
        self.evaluation = evaluation
        self._pending = deque(range(self.units))
        self._outstanding, self._done, self._handed, self._took = {}, set(), {}, []
        self._straggling = (0, 0.0)
        self.objective = 0.0

    @property
    def finished(self) -> bool:
        return len(self._done) == self.units

    def unit(self, index: int) -> WorkUnit:
        start = index * self.unit_size
        return WorkUnit(evaluation=self.evaluation, unit=index, start=start,
                        stop=min(start + self.unit_size, self.total), total=self.total)

    def assign(self, worker: Hashable) -> WorkUnit | None:
        """The next unit for this replica, a backup copy, or None (nothing useful to do)."""
        if self.finished or self.evaluation == 0:
            return None
        now = self.clock()
        if self._pending:
            index = self._pending.popleft()
            self._outstanding[index] = _Outstanding({worker}, now, now)
        else:
            backup = self._backup_for(worker, now)
            if backup is None:
                return None
            index = backup
            entry = self._outstanding[index]
            entry.holders.add(worker)
            entry.issued_at = now
            self.stats.backups += 1
        self.stats.issued += 1
        self._handed.setdefault(index, set()).add(worker)
        return self.unit(index)

    def _straggling_after(self) -> float | None:
        """Seconds out past which a unit is a straggler; None before any unit is done. Taken
        once per unit done: every waiting replica asks at an evaluation's tail."""
        if self._took and self._straggling[0] != len(self._took):
            self._straggling = (len(self._took), BACKUP_AFTER * float(np.median(self._took)))
        return self._straggling[1] if self._took else None

    def _backup_for(self, worker: Hashable, now: float) -> int | None:
        straggling = self._straggling_after()
        candidates = [(len(e.holders), e.issued_at, i) for i, e in self._outstanding.items()
                      if worker not in e.holders and (
                          (self.backups and straggling is not None and now - e.issued_at > straggling)
                          or now - e.issued_at >= self.reissue_after)]
        if not candidates:
            stale = [(e.issued_at, i) for i, e in self._outstanding.items() if now - e.issued_at >= self.reissue_after]
            return min(stale)[1] if stale else None  # even the holder may retry a unit long gone quiet
        return min(candidates)[2]

    def holds(self, worker: Hashable, evaluation: int, unit: int) -> bool:
        """Whether this replica was handed this unit of this evaluation."""
        return evaluation == self.evaluation and worker in self._handed.get(unit, ())

    def complete(self, worker: Hashable, evaluation: int, unit: int, loss: float) -> bool:
        """Record a result; True if it was the first for its unit (it counts)."""
        if evaluation != self.evaluation or unit not in self._outstanding:
            if evaluation == self.evaluation and unit in self._done:
                self.stats.duplicates += 1
            return False
        self._took.append(self.clock() - self._outstanding.pop(unit).first_issued_at)
        self._done.add(unit)
        self.objective += loss
        return True
