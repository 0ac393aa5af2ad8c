"""The shard's side of Sandblaster: its slices of the method's named vectors, and the ops
that the coordinator and the replicas send it (registered into the shard's op table).

Every op runs to completion inside the shard's single-threaded loop, so a vector is never
read half-written. Work-unit gradients are added once per unit and evaluation; a second
copy (a backup task's) or one for an evaluation that is over is dropped. COMMIT writes a
checkpoint of X, G and the history with the coordinator's scalar state; ROLLBACK reloads
one, so all shards can return to an iteration they all hold.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any, Mapping

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.algorithms.sandblaster import ops
from distbelief.runtime.algorithms.sandblaster.ops import Accumulated, EvaluationId, VectorCode, VectorResult
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.core import Shard
from distbelief.runtime.shard.plugin import Answer, Handler
from distbelief.runtime.wire.protocol import JsonObject, Message, OpSpec

log = logging.getLogger(__name__)

DOT_BLOCK = 64 * 1024        # dot products accumulate in float64, block by block
STATE_KEY = "sandblaster"    # the coordinator's state in the checkpoint's metadata
ARRAY_PREFIX = "sandblaster."


class Slots:
    """Slot numbers of the named vectors: x, g, d, the trial point and its gradient, then
    the history ring s_0..s_{m-1}, y_0..y_{m-1}."""

    X, G, D, XT, GT = range(5)
    DURABLE = (G,)   # besides X (the shard's parameters) and the history: what a commit saves

    def __init__(self, history: int) -> None:
        self.history = history
        self.count = 5 + 2 * history

    def s(self, i: int) -> int:
        return 5 + i

    def y(self, i: int) -> int:
        return 5 + self.history + i

    def durable(self) -> list[int]:
        return [*self.DURABLE, *range(5, self.count)]


class ShardVectors:
    """A shard plugin: the method's vectors beside the dense slice (X is the slice itself)."""

    def __init__(self, shard: Shard, dense: DenseSlice, history: int) -> None:
        self.shard = shard
        self.slots = Slots(history)
        size = dense.params.size
        self.vectors = [dense.params] + [np.zeros(size, dtype=np.float32) for _ in range(self.slots.count - 1)]
        self.incarnation = random.getrandbits(63) or 1
        self.evaluation = 0
        self.units = np.zeros(0, dtype=bool)
        self.units_added = 0
        self.coordinator_state: dict | None = None

    def handlers(self) -> Mapping[OpSpec, Handler]:
        return {ops.BEGIN_EVAL: self._begin_eval, ops.PULL_POINT: self._pull_point, ops.ACCUMULATE: self._accumulate,
                ops.VECTOR: self._vector, ops.COMMIT: self._commit, ops.ROLLBACK: self._rollback,
                ops.STATE: self._state}

    def repeat_handlers(self) -> Mapping[OpSpec, Handler]:
        return {}

    def array_values(self) -> int:
        return 0  # its arrays travel under the dense slice's size

    # -- checkpoints -----------------------------------------------------------------------

    def checkpoint_state(self, *, transfer: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays = {f"{ARRAY_PREFIX}{slot}": self.vectors[slot] for slot in self.slots.durable()}
        return arrays, {STATE_KEY: self.coordinator_state}

    def restore(self, ckpt: checkpoint.Checkpoint) -> None:
        for slot in self.slots.durable():
            saved = ckpt.arrays.get(f"{ARRAY_PREFIX}{slot}")
            self.vectors[slot][...] = 0 if saved is None else saved
        self.coordinator_state = ckpt.meta.get(STATE_KEY)
        self.evaluation, self.units, self.units_added = 0, np.zeros(0, dtype=bool), 0

    # -- evaluations: the replicas' side -------------------------------------------------

    def _begin_eval(self, message: Message) -> Answer:
        self.evaluation = message.meta.evaluation
        self.units = np.zeros(message.meta.units, dtype=bool)
        self.units_added = 0
        self.vectors[Slots.GT][...] = 0
        return self._result()

    def _pull_point(self, message: Message) -> Answer:
        point = self.vectors[Slots.XT].copy()  # a snapshot, as for a Downpour pull
        return Answer(meta=EvaluationId(self.evaluation), array=point)

    def _accumulate(self, message: Message) -> Answer:
        grad, unit = message.array, message.meta.unit
        if grad is None or grad.size != self.vectors[0].size:
            raise errors.ProtocolError(f"a unit gradient for shard {self.shard.index} must carry "
                                       f"{self.vectors[0].size} float32 values, header declares {message.header.count}")
        with np.errstate(over="ignore", invalid="ignore"):
            if not np.isfinite(np.dot(grad, grad)):
                raise errors.Refused("gradient has non-finite values; unit refused")
        if message.meta.evaluation != self.evaluation:
            return Answer(meta=Accumulated(evaluation=self.evaluation, added=0))
        if unit >= self.units.size:
            raise errors.ProtocolError(f"unit {unit} is not in evaluation {self.evaluation} ({self.units.size} units)")
        if self.units[unit]:
            return Answer(meta=Accumulated(evaluation=self.evaluation, added=0))
        self.vectors[Slots.GT] += grad
        self.units[unit] = True
        self.units_added += 1
        return Answer(meta=Accumulated(evaluation=self.evaluation, added=1))

    # -- the coordinator's commands ------------------------------------------------------

    def _vector(self, message: Message) -> Answer:
        command = message.meta
        for name, slot in (("out", command.out), ("a", command.a), ("b", command.b)):
            if slot >= self.slots.count:
                raise errors.ProtocolError(f"vector slot {name}={slot} out of range (the shard has {self.slots.count})")
        out, a, b = (self.vectors[i] for i in (command.out, command.a, command.b))
        value = 0.0
        if command.code == VectorCode.ZERO:
            out[...] = 0
        elif command.code == VectorCode.COPY:
            out[...] = a
        elif command.code == VectorCode.SCALE:
            out *= np.float32(command.scalar)
        elif command.code == VectorCode.AXPY:
            out += np.float32(command.scalar) * a
        else:
            value = _dot(a, b)
        return self._result(value)

    def _commit(self, message: Message) -> Answer:
        try:
            iteration, state = int(message.meta.value["iteration"]), message.meta.value["state"]
        except (KeyError, TypeError, ValueError) as exc:
            raise errors.ProtocolError(f"commit: needs an iteration and a state: {exc}") from exc
        if not isinstance(state, dict) or iteration < 0:
            raise errors.ProtocolError("commit: the state must be a JSON object, the iteration >= 0")
        shard = self.shard
        self.coordinator_state = state
        shard.step = iteration
        shard.metrics.global_step.set(shard.step)
        shard.checkpoint_now()
        shard.step_reached(shard.step)
        return self._result()

    def _rollback(self, message: Message) -> Answer:
        shard, iteration = self.shard, message.meta.iteration
        folder = shard.settings.checkpoint_dir
        path = os.path.join(folder, checkpoint.file_name(iteration))
        try:
            ckpt = checkpoint.load(path)
        except errors.CheckpointError as exc:
            raise errors.StateConflict(f"rollback to iteration {iteration}: {exc}") from exc
        if ckpt.layout != shard.layout.hash or ckpt.shard != shard.index:
            raise errors.StateConflict(f"rollback: {path} belongs to another shard or layout")
        shard.load(ckpt)
        for newer in checkpoint.list_checkpoints(folder):
            if checkpoint.step_of(newer) > iteration:
                os.remove(newer)  # an abandoned iteration: it must not win a later restore
        log.info("event=rolled_back shard=%d iteration=%d", shard.index, iteration)
        return self._result()

    def _state(self, message: Message) -> Answer:
        shard = self.shard
        held = sorted(checkpoint.step_of(p) for p in checkpoint.list_checkpoints(shard.settings.checkpoint_dir))
        return Answer(meta=JsonObject({
            "iteration": shard.step, "incarnation": self.incarnation, "coordinator": self.coordinator_state,
            "checkpoints": held, "evaluation": self.evaluation, "units": self.units_added}))

    def _result(self, value: float = 0.0) -> Answer:
        return Answer(meta=VectorResult(value=value, units=self.units_added, incarnation=self.incarnation))


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    total = 0.0
    for start in range(0, a.size, DOT_BLOCK):
        stop = start + DOT_BLOCK
        total += float(np.dot(a[start:stop].astype(np.float64), b[start:stop].astype(np.float64)))
    return total
