"""The shards' side of partitioned replicas: gradients held until their step commits.

A partitioned replica's step is computed by N pods, each pushing only its stage's
gradient to its own shards. Applying each as it arrives would leave half a step applied
whenever a pod of the group dies mid-step. So each pod's gradient is HELD under the
step's token (checked for staleness and finite values, but not applied), and partition
0, once the backward pass has reached it, which means every stage's gradient is held,
sends APPLY_HELD with the token to every shard. A step whose group broke is never
applied: its held gradients expire.

Held gradients are not checkpointed: a shard that restarts loses them, as it loses the
updates since its last checkpoint. At most MAX_HELD are kept (the oldest goes first),
each at most HELD_SECONDS; a copy of the slice each, so this bounds the memory they take.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.algorithms.pipeline.ops import APPLY_HELD, HOLD
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.plugin import Answer, Handler
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Message, OpSpec, Status

MAX_HELD = 8
HELD_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class HeldGradient:
    header: protocol.Header   # the HOLD's: its step is the one the gradient was computed from
    grad: np.ndarray
    since: float


class HeldGradients:
    def __init__(self, dense: DenseSlice) -> None:
        self.dense = dense
        self._held: OrderedDict[int, HeldGradient] = OrderedDict()

    def handlers(self) -> Mapping[OpSpec, Handler]:
        return {HOLD: self._hold, APPLY_HELD: self._apply}

    def repeat_handlers(self) -> Mapping[OpSpec, Handler]:
        return {}

    def array_values(self) -> int:
        return self.dense.array_values()

    def checkpoint_state(self, *, transfer: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return {}, {}

    def restore(self, ckpt: checkpoint.Checkpoint) -> None:
        """Nothing to restore: held gradients do not outlive the process."""

    def _hold(self, message: Message) -> Answer:
        if self.dense.too_stale(message.header.step):
            return Answer(status=Status.STALE)
        grad = self.dense.checked(message)
        self.dense.norm(grad)  # a non-finite gradient is refused now, before any shard applies its step
        self._expire(time.monotonic())
        # The received frame itself is kept (the array is a view of it), not a copy: a held
        # gradient costs one slice of memory, not two.
        self._held[message.meta.token] = HeldGradient(message.header, grad, time.monotonic())
        if len(self._held) > MAX_HELD:
            self._held.popitem(last=False)
        return Answer()

    def _apply(self, message: Message) -> Answer:
        held = self._held.pop(message.meta.token, None)
        if held is None:
            raise errors.StateConflict(
                f"shard {self.dense.shard.index} holds no gradient for step token {message.meta.token:016x}: "
                "it expired, or the shard restarted since")
        self.dense.apply(held.header, held.grad, examples=message.meta.examples, loss=message.meta.loss)
        return Answer()

    def _expire(self, now: float) -> None:
        while self._held and now - next(iter(self._held.values())).since > HELD_SECONDS:
            self._held.popitem(last=False)
