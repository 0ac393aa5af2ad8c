"""The ops of partitioned replicas, and their payloads.

Between the pods of one replica group (stage k to stage k+1, on the stage port):

    FORWARD   stage k's output activations and the labels of one micro-batch of a step
              (the whole minibatch unless spec.model.microBatches > 1)
              -> d(loss)/d(those activations), and the loss of the stages after k
              A step's micro-batches come in order, each sent before the one before it
              was answered; the answers come back in the same order. A PUSH part is
              answered twice: its gradient, then (once this stage and those after it
              held theirs) the worst of their HOLD statuses, with no payload.
    PREFETCH  "the step with this token will fetch": each stage passes it on and starts
              pulling its parameters at once, not when the step's FORWARD reaches it
              (no answer)

Between a partition pod and the shards of its stage, and partition 0 and every shard
(staged.py has the rules; every one names the group and its step's token):

    HOLD          a gradient the shard holds for the group's step, not yet applied
                  -> OK, STALE, or FULL (no room: back off and try again)
    PREPARE_HELD  partition 0, to every shard once every stage's gradient is held: pin it
                  -> OK, or an error if this shard lost it (then no shard applies the step)
    APPLY_HELD    partition 0, to every shard once every one pinned it: apply it
    DROP_HELD     partition 0, to every shard, for a step that will not be applied

Between a partition pod and the rendezvous beside shard 0:

    JOIN_GROUP  "I am partition k, serving at this address; put me in a group", asked again
              as a heartbeat while in one -> the group, or WAIT
"""

from __future__ import annotations

import dataclasses
import struct

from distbelief.runtime import errors
from distbelief.runtime.params.dense import Update
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import OpSpec

FETCH = 1   # Forward.flags: pull the stage's parameters before computing this step
PUSH = 2    # Forward.flags: hold the accumulated gradient on the shards after this step
MAX_ROWS = 1 << 20
MAX_WIDTH = 1 << 24
MAX_MICRO_BATCHES = 64   # spec.model.microBatches' bound


@dataclasses.dataclass(frozen=True)
class Forward(protocol.Payload):
    """Micro-batch `part` of `parts` of a step of step_rows rows: rows x width activations,
    then rows labels (in the array). FETCH comes with the first part, PUSH with the last."""

    group: int
    token: int
    rows: int
    width: int
    flags: int
    part: int
    parts: int
    step_rows: int
    FORMAT = struct.Struct("<QQIIBHHI")

    def check(self) -> None:
        if not (0 < self.rows <= self.step_rows <= MAX_ROWS and 0 < self.width <= MAX_WIDTH):
            raise errors.ProtocolError(f"a forward of {self.rows} of {self.step_rows} rows of width {self.width} "
                                       "is out of bounds")
        if self.flags & ~(FETCH | PUSH):
            raise errors.ProtocolError(f"unknown forward flags {self.flags:#x}")
        if not 0 <= self.part < self.parts <= MAX_MICRO_BATCHES:
            raise errors.ProtocolError(f"micro-batch {self.part} of {self.parts} (at most {MAX_MICRO_BATCHES})")
        if (self.flags & FETCH and self.part > 0) or (self.flags & PUSH and not self.last):
            raise errors.ProtocolError("FETCH goes with a step's first micro-batch, PUSH with its last")

    @property
    def last(self) -> bool:
        return self.part == self.parts - 1

    @property
    def share(self) -> float:
        """This micro-batch's fraction of its step's rows."""
        return self.rows / self.step_rows

    @property
    def values(self) -> int:
        return self.rows * self.width + self.rows


@dataclasses.dataclass(frozen=True)
class Backward(protocol.Payload):
    """The loss of the stages downstream (cross-entropy and their L2 terms)."""

    loss: float
    FORMAT = struct.Struct("<d")


@dataclasses.dataclass(frozen=True)
class Held(protocol.Payload):
    """The group and the token of the step a staged gradient belongs to."""

    group: int
    token: int
    FORMAT = struct.Struct("<QQ")

    def check(self) -> None:
        if self.group == 0:
            raise errors.ProtocolError("a held gradient belongs to a group; group 0 is none")


@dataclasses.dataclass(frozen=True)
class ApplyHeld(protocol.Payload):
    """Apply the group's gradient held under token; the whole replica's examples and mean loss."""

    group: int
    token: int
    examples: int
    loss: float
    FORMAT = struct.Struct("<QQIf")

    def check(self) -> None:
        Held(self.group, self.token).check()
        Update(self.examples, self.loss).check()  # what a step stands for, checked as a push's


FORWARD = protocol.define(OpSpec(40, "FORWARD", request=Forward, reply=Backward, request_array=True,
                                 reply_array=True))
HOLD = protocol.define(OpSpec(41, "HOLD", request=Held, request_array=True, command=True))
APPLY_HELD = protocol.define(OpSpec(42, "APPLY_HELD", request=ApplyHeld, command=True))
JOIN_GROUP = protocol.define(OpSpec(43, "JOIN_GROUP", request=protocol.JsonObject, reply=protocol.JsonObject))
PREPARE_HELD = protocol.define(OpSpec(44, "PREPARE_HELD", request=Held, command=True))
DROP_HELD = protocol.define(OpSpec(45, "DROP_HELD", request=Held, command=True))
PREFETCH = protocol.define(OpSpec(46, "PREFETCH", request=Held))
