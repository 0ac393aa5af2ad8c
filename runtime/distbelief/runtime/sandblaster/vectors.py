"""The shard's side of Sandblaster: its slices of the method's named vectors, and the ops
that the coordinator and the replicas send it (registered into the shard's op table).

Every op runs to completion inside the shard's single-threaded loop, so a vector is never
read half-written. Work-unit gradients are added once per unit and evaluation; a second
copy (a backup task's) or one for an evaluation that is over is dropped. COMMIT writes a
checkpoint of X, G and the history with the coordinator's scalar state; ROLLBACK reloads
one, so all shards can return to an iteration they all hold.
"""

from __future__ import annotations

import json
import logging
import os
import random

import numpy as np

from distbelief.runtime import checkpoint, errors, protocol
from distbelief.runtime.protocol import Header, Op, Status, VectorCode, VectorCommand, VectorResult

log = logging.getLogger(__name__)

MAX_UNITS = 1 << 20          # work units in one evaluation
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
    """Attach to a Shard: adds the Sandblaster ops and takes Downpour's push away."""

    def __init__(self, shard, history: int) -> None:
        self.shard = shard
        self.slots = Slots(history)
        size = shard.params.size
        self.vectors = [shard.params] + [np.zeros(size, dtype=np.float32) for _ in range(self.slots.count - 1)]
        self.incarnation = random.getrandbits(63) or 1
        self.evaluation = 0
        self.units = np.zeros(0, dtype=bool)
        self.units_added = 0
        self.coordinator_state: dict | None = None
        shard.extension = self
        for op, handler in ((Op.BEGIN_EVAL, self._begin_eval), (Op.PULL_POINT, self._pull_point),
                            (Op.ACCUMULATE, self._accumulate), (Op.VECTOR, self._vector),
                            (Op.COMMIT, self._commit), (Op.ROLLBACK, self._rollback), (Op.STATE, self._state)):
            shard.register(op, handler)
        shard.register(Op.PUSH, None)

    # -- checkpoint extension ------------------------------------------------------------

    def arrays(self) -> dict[str, np.ndarray]:
        return {f"{ARRAY_PREFIX}{slot}": self.vectors[slot] for slot in self.slots.durable()}

    def meta(self) -> dict:
        return {STATE_KEY: self.coordinator_state}

    def restore(self, ckpt: checkpoint.Checkpoint) -> None:
        for slot in self.slots.durable():
            saved = ckpt.arrays.get(f"{ARRAY_PREFIX}{slot}")
            self.vectors[slot][...] = 0 if saved is None else saved
        self.coordinator_state = ckpt.meta.get(STATE_KEY)
        self.evaluation, self.units, self.units_added = 0, np.zeros(0, dtype=bool), 0

    # -- evaluations: the replicas' side -------------------------------------------------

    def _begin_eval(self, header: Header, payload: list) -> list:
        if not 0 < header.count <= MAX_UNITS or header.step == 0:
            raise errors.ProtocolError(f"an evaluation needs an id and 1..{MAX_UNITS} units (got {header.count})")
        self.evaluation = header.step
        self.units = np.zeros(header.count, dtype=bool)
        self.units_added = 0
        self.vectors[Slots.GT][...] = 0
        return self._reply(header)

    def _pull_point(self, header: Header, payload: list) -> list:
        if payload:
            raise errors.ProtocolError("a pull carries no payload")
        point = self.vectors[Slots.XT].copy()  # a snapshot, as for a Downpour pull
        return self._finished(header) or [header.reply(step=self.evaluation, count=point.size).pack(),
                                          memoryview(point)]

    def _accumulate(self, header: Header, payload: list) -> list:
        finished = self._finished(header)
        if finished:
            return finished
        size = self.shard.params.size
        if len(payload) != 1 or header.count != size:
            raise errors.ProtocolError(f"a unit gradient for shard {self.shard.index} must carry {size} "
                                       f"float32 values, header declares {header.count}")
        grad = protocol.float_view(payload[0].buffer, header.count)
        with np.errstate(over="ignore", invalid="ignore"):
            if not np.isfinite(np.dot(grad, grad)):
                raise errors.ProtocolError("gradient has non-finite values; unit refused")
        unit = header.examples
        if header.step != self.evaluation:
            return [header.reply(step=self.evaluation, count=0).pack()]
        if unit >= self.units.size:
            raise errors.ProtocolError(f"unit {unit} is not in evaluation {header.step} ({self.units.size} units)")
        if self.units[unit]:
            return [header.reply(step=self.evaluation, count=0).pack()]
        self.vectors[Slots.GT] += grad
        self.units[unit] = True
        self.units_added += 1
        return [header.reply(step=self.evaluation, count=1).pack()]

    # -- the coordinator's commands ------------------------------------------------------

    def _vector(self, header: Header, payload: list) -> list:
        if len(payload) != 1:
            raise errors.ProtocolError("a vector op carries one command")
        command = VectorCommand.unpack(payload[0].buffer, self.slots.count)
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
        return self._reply(header, value)

    def _commit(self, header: Header, payload: list) -> list:
        if len(payload) != 1:
            raise errors.ProtocolError("a commit carries the coordinator's state")
        try:
            state = json.loads(protocol.decode_text(payload[0].buffer))
        except ValueError as exc:
            raise errors.ProtocolError(f"commit: unreadable state: {exc}") from exc
        if not isinstance(state, dict):
            raise errors.ProtocolError("commit: the state must be a JSON object")
        shard = self.shard
        self.coordinator_state = state
        shard.step = header.step
        shard.metrics.global_step.set(shard.step)
        shard.checkpoint_now()
        shard.step_reached(shard.step)
        return self._reply(header)

    def _rollback(self, header: Header, payload: list) -> list:
        shard = self.shard
        folder = shard.settings.checkpoint_dir
        path = os.path.join(folder, checkpoint.file_name(header.step))
        try:
            ckpt = checkpoint.load(path)
        except errors.CheckpointError as exc:
            raise errors.ProtocolError(f"rollback to iteration {header.step}: {exc}") from exc
        if ckpt.layout != shard.layout.hash or ckpt.shard != shard.index:
            raise errors.ProtocolError(f"rollback: {path} belongs to another shard or layout")
        shard.load(ckpt)
        for newer in checkpoint.list_checkpoints(folder):
            if checkpoint.step_of(newer) > header.step:
                os.remove(newer)  # an abandoned iteration: it must not win a later restore
        log.info("event=rolled_back shard=%d iteration=%d", shard.index, header.step)
        return self._reply(header)

    def _state(self, header: Header, payload: list) -> list:
        shard = self.shard
        held = sorted(checkpoint.step_of(p) for p in checkpoint.list_checkpoints(shard.settings.checkpoint_dir))
        state = {"iteration": shard.step, "incarnation": self.incarnation, "coordinator": self.coordinator_state,
                 "checkpoints": held, "evaluation": self.evaluation, "units": self.units_added,
                 "finished": shard.finished}
        status = Status.DONE if shard.finished else Status.OK
        return [header.reply(status=status, step=shard.step).pack(), json.dumps(state).encode()]

    # -- replies -------------------------------------------------------------------------

    def _reply(self, header: Header, value: float = 0.0) -> list:
        finished = self._finished(header)
        if finished:
            return finished
        result = VectorResult(value=value, units=self.units_added, incarnation=self.incarnation)
        return [header.reply(step=self.evaluation).pack(), result.pack()]

    def _finished(self, header: Header) -> list | None:
        if self.shard.finished is None:
            return None
        return [header.reply(status=Status.DONE, step=self.shard.step).pack(),
                json.dumps(self.shard.finished).encode()]


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    total = 0.0
    for start in range(0, a.size, DOT_BLOCK):
        stop = start + DOT_BLOCK
        total += float(np.dot(a[start:stop].astype(np.float64), b[start:stop].astype(np.float64)))
    return total
