"""Sandblaster's ops on the wire, their payloads, and the calls that send them.

    BEGIN_EVAL   Evaluation in (id, units)             -> VectorResult
    PULL_POINT                                         -> EvaluationId + the trial point
    ACCUMULATE   UnitGradient in (evaluation, unit) + the unit's gradient -> Accumulated
    VECTOR       VectorCommand in                      -> VectorResult
    COMMIT       JSON in {iteration, state}            -> VectorResult
    ROLLBACK     Iteration in                          -> VectorResult
    STATE                                              -> JSON (iteration, incarnation, ...)
    WORK         replica -> coordinator: UnitResult of the last unit, if any;
                 reply: OK + WorkUnit, WAIT, or DONE
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.client.group import Reply, ShardGroup
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import JsonObject, OpSpec, Payload

MAX_UNITS = 1 << 20          # work units in one evaluation


class VectorCode(enum.IntEnum):
    """What a VECTOR command does with the shard's named vectors (out, a, b are slots)."""

    ZERO = 1    # out = 0
    COPY = 2    # out = a
    SCALE = 3   # out *= scalar
    AXPY = 4    # out += scalar * a
    DOT = 5     # -> a . b (this shard's part of it)


@dataclasses.dataclass(frozen=True)
class VectorCommand(Payload):
    code: int
    out: int = 0
    a: int = 0
    b: int = 0
    scalar: float = 0.0
    FORMAT = struct.Struct("<BBBBxxxxd")

    def check(self) -> None:
        if self.code not in VectorCode._value2member_map_:
            raise errors.ProtocolError(f"unknown vector op {self.code}")
        if not np.isfinite(self.scalar) or abs(self.scalar) > float(np.finfo(np.float32).max):
            raise errors.ProtocolError("vector op scalar is not a finite float32 number")


@dataclasses.dataclass(frozen=True)
class VectorResult(Payload):
    value: float      # the dot product (0 for other ops)
    units: int        # work units accumulated in the shard's current evaluation
    incarnation: int  # changes when the shard process restarts
    FORMAT = struct.Struct("<dQQ")

    def check(self) -> None:
        if not np.isfinite(self.value):
            raise errors.ProtocolError("vector result is not a finite number")


@dataclasses.dataclass(frozen=True)
class Evaluation(Payload):
    evaluation: int
    units: int
    FORMAT = struct.Struct("<QI")

    def check(self) -> None:
        if self.evaluation == 0 or not 0 < self.units <= MAX_UNITS:
            raise errors.ProtocolError(f"an evaluation needs an id and 1..{MAX_UNITS} units (got {self.units})")


@dataclasses.dataclass(frozen=True)
class EvaluationId(Payload):
    evaluation: int
    FORMAT = struct.Struct("<Q")


@dataclasses.dataclass(frozen=True)
class UnitGradient(Payload):
    evaluation: int
    unit: int
    FORMAT = struct.Struct("<QI")


@dataclasses.dataclass(frozen=True)
class Accumulated(Payload):
    evaluation: int   # the evaluation the shard is in
    added: int        # 1 if the gradient was added, 0 if dropped (a duplicate, a stale evaluation)
    FORMAT = struct.Struct("<QB")


@dataclasses.dataclass(frozen=True)
class Iteration(Payload):
    iteration: int
    FORMAT = struct.Struct("<Q")


@dataclasses.dataclass(frozen=True)
class WorkUnit(Payload):
    """Examples [start, stop) of the training set, to evaluate at evaluation `evaluation`'s
    point; `total` examples make up the whole batch (the gradient is weighted by share)."""

    evaluation: int
    unit: int
    start: int
    stop: int
    total: int
    FORMAT = struct.Struct("<QIIII")

    def check(self) -> None:
        if not 0 <= self.start < self.stop <= self.total:
            raise errors.ProtocolError(f"work unit [{self.start}, {self.stop}) is not within a batch of {self.total}")


@dataclasses.dataclass(frozen=True)
class UnitResult(Payload):
    """A replica's answer for one work unit: its share of the objective, or `lost` when a
    shard no longer held the unit's evaluation (it restarted)."""

    evaluation: int
    unit: int
    examples: int
    loss: float
    lost: bool = False
    FORMAT = struct.Struct("<QIIdB7x")

    def check(self) -> None:
        if not abs(self.loss) <= protocol.MAX_LOSS:  # also false for NaN
            raise errors.ProtocolError("unit result loss is not a finite number")
        if self.examples > protocol.MAX_EXAMPLES:
            raise errors.ProtocolError(f"a unit result may stand for at most {protocol.MAX_EXAMPLES} examples")


BEGIN_EVAL = protocol.define(OpSpec(6, "BEGIN_EVAL", request=Evaluation, reply=VectorResult, command=True, privileged=True))
PULL_POINT = protocol.define(OpSpec(7, "PULL_POINT", reply=EvaluationId, reply_array=True))
ACCUMULATE = protocol.define(OpSpec(8, "ACCUMULATE", request=UnitGradient, request_array=True,
                                    reply=Accumulated, command=True))
VECTOR = protocol.define(OpSpec(9, "VECTOR", request=VectorCommand, reply=VectorResult, command=True, privileged=True))
COMMIT = protocol.define(OpSpec(10, "COMMIT", request=JsonObject, reply=VectorResult, command=True, privileged=True))
ROLLBACK = protocol.define(OpSpec(11, "ROLLBACK", request=Iteration, reply=VectorResult, command=True, privileged=True))
STATE = protocol.define(OpSpec(12, "STATE", reply=JsonObject))
WORK = protocol.define(OpSpec(13, "WORK", request=UnitResult, reply=WorkUnit, optional_request=True))


class SandblasterShards:
    """The Sandblaster calls on a job's shards (the coordinator's and the replicas')."""

    def __init__(self, group: ShardGroup) -> None:
        self.group = group

    def begin_evaluation(self, evaluation: int, units: int) -> list[Reply]:
        return self.group.request(BEGIN_EVAL, meta=Evaluation(evaluation=evaluation, units=units))

    def pull_point(self, out: np.ndarray) -> list[Reply]:
        """Fill out with the trial point; each reply's meta names that shard's evaluation."""
        return self.group.request(PULL_POINT, receive_into=out)

    def accumulate(self, grad: np.ndarray, *, evaluation: int, unit: int) -> list[Reply]:
        return self.group.request(ACCUMULATE, array=grad, meta=UnitGradient(evaluation=evaluation, unit=unit))

    def vector(self, command: VectorCommand) -> list[Reply]:
        return self.group.request(VECTOR, meta=command)

    def commit(self, iteration: int, state: dict) -> list[Reply]:
        return self.group.request(COMMIT, meta=JsonObject({"iteration": iteration, "state": state}))

    def rollback(self, iteration: int) -> list[Reply]:
        return self.group.request(ROLLBACK, meta=Iteration(iteration=iteration))

    def state(self) -> list[dict]:
        """Every shard's Sandblaster state; JobFinished once the job is done."""
        replies = self.group.request(STATE)
        if any(r.done for r in replies):
            raise errors.JobFinished()
        return [r.meta.value for r in replies]
