"""When a shard writes its checkpoints: on an interval, when asked, and never a bad state.

A checkpoint is written when the step moved and the interval passed (or at once when
asked: at the end, on DONE, on a Sandblaster commit). A checkpoint that cannot be written
(or a row file it would name: params/rows/rowcheckpoint.py) is logged and tried again at the next
interval; a state with a non-finite value is never written, the shard goes back to its
newest checkpoint that restores whole instead.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Protocol

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.wire.layout import Layout

log = logging.getLogger(__name__)


class Saved(Protocol):
    """What the schedule needs of the shard whose checkpoints it writes (core.Shard)."""

    index: int
    step: int
    finished: dict | None
    layout: Layout
    metrics: ShardMetrics
    settings: Any  # core.ShardSettings: checkpoint_dir, checkpoint_every, checkpoint_keep

    def snapshot(self, *, transfer: bool = False) -> checkpoint.Checkpoint: ...

    def load(self, ckpt: checkpoint.Checkpoint) -> None: ...


class CheckpointSchedule:
    def __init__(self, shard: Saved) -> None:
        self.shard = shard
        self.last = (time.monotonic(), -1)  # (when, step) of the newest checkpoint
        self.failures = 0  # in a row; reset by the next checkpoint that lands
        self.saved_finished = False
        self.paused = False  # a copy catching up holds a mixed state: none is written

    def taken(self, step: int) -> None:
        """The shard holds the state of a checkpoint of this step (it just loaded one)."""
        self.last = (time.monotonic(), step)
        self.shard.metrics.checkpoint_step.set(step)

    def maybe(self) -> None:
        when, step = self.last
        if step != self.shard.step and time.monotonic() - when >= self.shard.settings.checkpoint_every:
            self.now()

    def now(self) -> None:
        """Write a checkpoint of the current state if it differs from the last one."""
        shard = self.shard
        if self.paused or (self.last[1] == shard.step and not self._finished_unsaved()):
            return
        folder = shard.settings.checkpoint_dir
        try:
            ckpt = shard.snapshot()  # a plugin may write files of its own first (the sparse rows')
            if not all(np.isfinite(array).all() for array in ckpt.arrays.values()):
                self._recover_from_non_finite_state()
                return
            path = checkpoint.save(folder, ckpt, keep=shard.settings.checkpoint_keep)
        except errors.CheckpointError as exc:
            # Training goes on from memory; the previous checkpoints are untouched, and the
            # next interval tries again (a full or unwritable folder may come back).
            self.failures += 1
            log.error("event=checkpoint_failed shard=%d step=%d folder=%s failures=%d error=%r", shard.index,
                      shard.step, folder, self.failures, str(exc))
            self.last = (time.monotonic(), self.last[1])
            return
        if self.failures:
            log.info("event=checkpoint_resumed shard=%d step=%d after_failures=%d", shard.index, shard.step,
                     self.failures)
            self.failures = 0
        self.last = (time.monotonic(), ckpt.step)
        self.saved_finished = shard.finished is not None
        shard.metrics.checkpoint_step.set(ckpt.step)
        shard.metrics.checkpoint_time.set(time.time())
        log.info("event=checkpoint shard=%d step=%d path=%s", shard.index, ckpt.step, os.path.basename(path))

    def _recover_from_non_finite_state(self) -> None:
        """A non-finite value got into the state (an update overflowed): it must never reach a
        checkpoint, where it would push out the good ones. Go back to the newest checkpoint,
        all of which were finite when written; without one, stop and be restarted afresh."""
        shard = self.shard
        shard.metrics.non_finite.inc()
        step = shard.step
        ckpt = checkpoint.restore_latest(shard.settings.checkpoint_dir, layout=shard.layout.hash, shard=shard.index,
                                         job_uid=shard.settings.job_uid, accept=shard.load)
        if ckpt is None:
            raise errors.RuntimeFailure(f"shard {shard.index}: its state holds non-finite values and no checkpoint "
                                        "to go back to")
        log.error("event=non_finite_state shard=%d step=%d action=restored_checkpoint checkpoint_step=%d",
                  shard.index, step, ckpt.step)

    def _finished_unsaved(self) -> bool:
        return self.shard.finished is not None and not self.saved_finished
