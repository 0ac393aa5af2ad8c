"""One model replica under Sandblaster: asks the coordinator for work units, evaluates
each at the current trial point, and adds the unit's gradient to the shards.

    WORK (with the last unit's result) -> a unit: examples [start, stop) of the batch
    the first unit of an evaluation: pull the trial point from every shard
    gradient of the unit's mean loss, weighted by its share of the batch -> ACCUMULATE

Weighting by share makes the units' sum the gradient of the whole batch's objective,
whatever replica computed which unit. If a shard answers that it holds another
evaluation than the unit's, the replica reports the unit as lost (the shard restarted).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.algorithms.chiefport import ChiefPortLink
from distbelief.runtime.algorithms.sandblaster import ops
from distbelief.runtime.algorithms.sandblaster.ops import SandblasterShards, UnitResult, WorkUnit
from distbelief.runtime.client.group import ShardGroup
from distbelief.runtime.model.data import Dataset
from distbelief.runtime.model.models import Model
from distbelief.runtime.observe.metrics import WorkerMetrics
from distbelief.runtime.wire.protocol import Status

log = logging.getLogger(__name__)

class CoordinatorLink(ChiefPortLink):
    """The replica's request/reply channel to the coordinator."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        super().__init__(address, who="the coordinator", **kwargs)

    def ask(self, result: UnitResult | None) -> tuple[int, WorkUnit | None]:
        """Send the last result, wait for the next unit: (status, unit)."""
        return self.request(ops.WORK, result, WorkUnit)  # type: ignore[return-value]


class Replica:
    def __init__(self, group: ShardGroup, link: CoordinatorLink, model: Model, dataset: Dataset,
                 metrics: WorkerMetrics, *, stop: threading.Event) -> None:
        self.group, self.link, self.model, self.metrics = group, link, model, metrics
        self.shards = SandblasterShards(group)
        self.x, self.y = dataset.x_train, dataset.y_train
        self.stop_requested = stop
        self.joined = threading.Event()
        self.point = np.empty(group.layout.total, dtype=np.float32)
        self.grad = np.empty(group.layout.total, dtype=np.float32)
        self.evaluation = 0   # the evaluation whose trial point self.point holds
        self.steps = 0

    def run(self) -> str:
        try:
            return self._serve()
        finally:
            self.link.close()

    def _serve(self) -> str:
        result: UnitResult | None = None
        while not self.stop_requested.is_set():
            status, unit = self.link.ask(result)
            self.joined.set()
            if status == Status.DONE:
                return "done"
            if unit is None:
                result = None
                continue
            try:
                result = self._work(unit)
            except errors.JobFinished:
                return "done"
        return "stopped"

    def _work(self, unit: WorkUnit) -> UnitResult:
        if unit.evaluation != self.evaluation and not self._pull(unit.evaluation):
            return UnitResult(evaluation=unit.evaluation, unit=unit.unit, examples=0, loss=0.0, lost=True)
        n = unit.stop - unit.start
        share = n / unit.total
        batch = (self.x[unit.start:unit.stop], self.y[unit.start:unit.stop])
        loss, _ = self.model.loss_and_grad(self.point, batch, out=self.grad)
        self.grad *= np.float32(share)
        self.metrics.steps.inc()
        self.metrics.examples.inc(n)
        self.metrics.loss.set(loss)
        started = time.perf_counter()
        replies = self.shards.accumulate(self.grad, evaluation=unit.evaluation, unit=unit.unit)
        self.metrics.push_seconds.observe(time.perf_counter() - started)
        if any(r.done for r in replies):
            raise errors.JobFinished()
        self.steps += 1
        lost = any(r.meta.evaluation != unit.evaluation for r in replies)
        return UnitResult(evaluation=unit.evaluation, unit=unit.unit, examples=n, loss=loss * share, lost=lost)

    def _pull(self, evaluation: int) -> bool:
        """The trial point of this evaluation; False if a shard holds another one."""
        started = time.perf_counter()
        replies = self.shards.pull_point(self.point)
        self.metrics.pull_seconds.observe(time.perf_counter() - started)
        if any(r.done for r in replies):
            raise errors.JobFinished()
        if any(r.meta.evaluation != evaluation for r in replies):
            self.evaluation = 0
            return False
        self.evaluation = evaluation
        return True
