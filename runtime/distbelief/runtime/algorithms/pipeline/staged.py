"""The shards' side of partitioned replicas: gradients held until their step commits.

A partitioned replica's step is computed by N pods, each pushing only its stage's
gradient to its own shards. Applying each as it arrives would leave half a step applied
whenever a pod of the group dies mid-step. So each pod's gradient is HELD for its group's
step (checked for staleness and finite values, but not applied), and partition 0, once
every stage's HOLD status has reached it (every stage's gradient is then held, or
refused), commits the step on every shard in two phases:

    PREPARE_HELD  "do you hold this step?": a shard that does pins it (a pinned hold is
                  never dropped to make room); one that does not answers an error
    APPLY_HELD    sent only once every shard pinned it: each applies it
    DROP_HELD     sent instead when any shard did not pin it, or the step was not to be
                  applied at all (too stale, no room, a non-finite loss)

So a step is applied on every shard or on none, whoever else holds steps meanwhile: the
remaining windows are a shard that restarts, or partition 0 that dies, between the
phases (docs/reliability.md).

Room. A hold is a copy of the slice, so a shard keeps at most MAX_HELD, one per group (a
group has one step in flight, so a group's HOLD replaces its older one). A hold is live
for HELD_SECONDS after it was made, and once pinned for PINNED_SECONDS after that; live
holds are never dropped. A HOLD that finds MAX_HELD holds makes room by dropping the oldest
hold that is no longer live (its group broke mid-step); if all are live, it is refused
with Status.FULL and the group drops its step, backs off and tries again (replica.py).

Time is the shard's command_time: the wall clock of the primary that took the command, so
that every copy of a shard (spec.parameterServers.backups) holds, drops and refuses alike.
HOLD, PREPARE_HELD, APPLY_HELD and DROP_HELD are commands: a primary acknowledges each only
once every copy in sync applied it, so a backup that takes over holds every hold and pin
its primary acknowledged, and a step pinned everywhere is applied everywhere. A copy
catching up receives the holds first (plugin.Transferable), before any part of the slice.

Held gradients are not checkpointed: a shard whose every copy restarts loses them, as it
loses the updates since its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.algorithms.pipeline.ops import APPLY_HELD, DROP_HELD, HOLD, PREPARE_HELD, ApplyHeld, Held
from distbelief.runtime.params.dense import PART_VALUES, DenseSlice
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.plugin import Answer, Handler
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Message, OpSpec, Status

log = logging.getLogger(__name__)

MAX_HELD = 8
HELD_SECONDS = 120.0     # a step's holds, from its last stage's to partition 0's PREPARE_HELD
PINNED_SECONDS = 600.0   # from PREPARE_HELD to APPLY_HELD: longer than a client waits for a shard


@dataclasses.dataclass
class HeldGradient:
    token: int
    header: protocol.Header   # the HOLD's: its step is the one the gradient was computed from
    grad: np.ndarray
    since: float              # when it was held, or pinned once it is
    pinned: bool = False

    def live(self, now: float) -> bool:
        return now - self.since <= (PINNED_SECONDS if self.pinned else HELD_SECONDS)


class HeldGradients:
    def __init__(self, dense: DenseSlice) -> None:
        self.dense = dense
        self.held: dict[int, HeldGradient] = {}  # by group
        self.refused = 0                          # HOLDs refused for want of room
        self._receiving: dict[str, Any] = {}  # a transfer's plan, while it comes in

    def handlers(self) -> Mapping[OpSpec, Handler]:
        return {HOLD: self._hold, PREPARE_HELD: self._prepare, APPLY_HELD: self._apply, DROP_HELD: self._drop}

    def repeat_handlers(self) -> Mapping[OpSpec, Handler]:
        return {}

    def array_values(self) -> int:
        return self.dense.array_values()

    def checkpoint_state(self, *, transfer: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return {}, {}

    def restore(self, ckpt: checkpoint.Checkpoint) -> None:
        """Nothing to restore: held gradients do not outlive the process."""

    # -- a copy catching up (plugin.Transferable) ------------------------------------------------

    def transfer_plan(self) -> dict[str, Any]:
        """Each hold's step and state, and its gradient in parts of the slice's part size,
        all sent before the slice's own parts ("first"): APPLY_HELD writes a hold into the
        slice, so a hold whose gradient has not all come in yet may be applied only while no
        part of the slice has (the slice's parts then bring the values it applied)."""
        holds = [{"group": group, "token": h.token, "header": h.header.pack().hex(), "since": h.since,
                  "pinned": h.pinned} for group, h in self.held.items()]
        pieces = max(1, -(-self.dense.params.size // PART_VALUES))
        return {"parts": len(holds) * pieces, "pieces": pieces, "first": True, "holds": holds}

    def read_part(self, plan: dict[str, Any], part: int) -> dict[str, np.ndarray]:
        """A piece of one of the plan's holds, or nothing if it was applied or dropped since."""
        wanted, start = plan["holds"][part // plan["pieces"]], (part % plan["pieces"]) * PART_VALUES
        held = self.held.get(wanted["group"])
        gone = held is None or held.token != wanted["token"]
        return {"grad": np.empty(0, np.float32) if gone else held.grad[start:start + PART_VALUES].copy()}

    def begin_receiving(self, plan: dict[str, Any]) -> None:
        """The plan's holds, their gradients zero until their parts come in."""
        self.held, self._receiving = {}, plan
        for hold in plan["holds"]:
            try:
                header = protocol.unpack_header(bytes.fromhex(hold["header"]))
                self.held[int(hold["group"])] = HeldGradient(int(hold["token"]), header,
                                                             np.zeros_like(self.dense.params),
                                                             float(hold["since"]), bool(hold["pinned"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise errors.ProtocolError(f"a transferred hold {str(hold)[:200]}: {exc}") from exc

    def write_part(self, part: int, arrays: dict[str, np.ndarray]) -> None:
        plan = self._receiving
        if not plan or not 0 <= part < plan["parts"]:
            raise errors.ProtocolError(f"hold part {part} of {plan.get('parts', 0) if plan else 0}")
        wanted, start = plan["holds"][part // plan["pieces"]], (part % plan["pieces"]) * PART_VALUES
        held, grad = self.held.get(wanted["group"]), arrays.get("grad")
        if held is None or held.token != wanted["token"] or grad is None or grad.size == 0:
            return  # applied, dropped or replaced since the plan, here as on the primary
        target = held.grad[start:start + PART_VALUES]
        if grad.shape != target.shape or grad.dtype != target.dtype:
            raise errors.ProtocolError(f"piece {part} of a held gradient: {grad.shape} {grad.dtype}, expected "
                                       f"{target.shape} {target.dtype}")
        target[...] = grad

    def end_receiving(self) -> None:
        self._receiving = {}

    def _hold(self, message: Message) -> Answer:
        meta: Held = message.meta
        self.held.pop(meta.group, None)  # the group's earlier step is over, applied or not
        if self.dense.too_stale(message.header.step):
            return Answer(status=Status.STALE)
        grad = self.dense.checked(message)
        self.dense.norm(grad)  # a non-finite gradient is refused now, before any shard applies its step
        now = self.dense.shard.command_time
        if len(self.held) >= MAX_HELD and not self._make_room(now):
            self.refused += 1
            log.debug("event=hold_refused shard=%d group=%016x reason=full held=%d",
                     self.dense.shard.index, meta.group, len(self.held))
            return Answer(status=Status.FULL)
        # The received frame itself is kept (the array is a view of it), not a copy: a held
        # gradient costs one slice of memory, not two.
        self.held[meta.group] = HeldGradient(meta.token, message.header, grad, now)
        return Answer()

    def _prepare(self, message: Message) -> Answer:
        held = self._find(message.meta.group, message.meta.token)
        held.pinned, held.since = True, self.dense.shard.command_time
        return Answer()

    def _apply(self, message: Message) -> Answer:
        meta: ApplyHeld = message.meta
        held = self._find(meta.group, meta.token)
        if not held.pinned:
            raise errors.StateConflict(f"shard {self.dense.shard.index}: step token {meta.token:016x} "
                                       "was not prepared (PREPARE_HELD comes before APPLY_HELD)")
        del self.held[meta.group]
        self.dense.apply(held.header, held.grad, examples=meta.examples, loss=meta.loss)
        return Answer()

    def _drop(self, message: Message) -> Answer:
        meta: Held = message.meta
        held = self.held.get(meta.group)
        if held is not None and held.token == meta.token:
            del self.held[meta.group]
        return Answer()

    def _find(self, group: int, token: int) -> HeldGradient:
        held = self.held.get(group)
        if held is None or held.token != token:
            raise errors.StateConflict(
                f"shard {self.dense.shard.index} holds no gradient for step token {token:016x}: it was "
                f"held longer than {HELD_SECONDS:.0f} s and dropped for room, or the shard restarted since")
        return held

    def _make_room(self, now: float) -> bool:
        """Drop the oldest hold that is no longer live; False if every one is."""
        gone = [(h.since, group) for group, h in self.held.items() if not h.live(now)]
        if not gone:
            return False
        _, group = min(gone)
        log.info("event=hold_dropped shard=%d group=%016x reason=expired", self.dense.shard.index, group)
        del self.held[group]
        return True
