"""Dense parameters: a shard's contiguous slice of the flat parameter vector, as a plugin.

    PULL       -> the slice (a snapshot: the next push may update it while ZeroMQ sends)
    PUSH       gradient in (with the examples and mean loss behind it) -> the new step
    PUSH_PULL  gradient in -> the slice with it applied: a push and the next pull in one
               round trip, when a replica fetches right after it pushes

The slice's optimizer comes from the registry in optim.py; its state is saved in the
shard's checkpoints, and a checkpoint written by another optimizer is refused on restore.

With spec.training.maxStaleness (tau), a push computed from parameters more than tau of
this shard's updates old is not applied: the reply says STALE (and a PUSH_PULL's brings
the fresh slice), and the replica computes again from fresh parameters. tau = 0 makes
Downpour synchronous per shard; unset, every push is applied (plain Downpour).

A pushed gradient with a non-finite value is refused. One whose norm (over this shard's
slice) exceeds spec.training.maxGradientNorm is scaled down to it, not refused: a clip
keeps an honest replica's rare spike training, and bounds what one poisoned push can do
(it can no longer drive a weight, or an Adagrad accumulator, to overflow). Clipped
updates are counted (distbelief_clipped_updates_total), so a bound that bites honest
training shows.
Algorithms that do not train by pushes (Sandblaster) attach the slice with pushes=False,
and neither PUSH nor PUSH_PULL is then served.

With spec.parameterServers.wireFormat bfloat16, replicas push with PUSH_BF16 and
PUSH_PULL_BF16: the gradient arrives as bfloat16, is widened into one float32 buffer and
applied like any other; the slice, the optimizer's state and the checkpoints stay float32
(master weights). PULL_BF16 sends the slice rounded to bfloat16. A push in the other
format than the job's is refused, never read as the wrong one; pulls are served in both
(the chief reads the float32 master weights).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Mapping

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.params.optim import make_optimizer
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.core import Shard
from distbelief.runtime.shard.plugin import Answer, Handler
from distbelief.runtime.wire import bfloat16, protocol
from distbelief.runtime.wire.protocol import Message, OpSpec, Status


@dataclasses.dataclass(frozen=True)
class Update(protocol.Payload):
    """What a pushed gradient stands for: its examples and their mean loss."""

    examples: int
    loss: float
    FORMAT = struct.Struct("<If")

    def check(self) -> None:
        if not 0 < self.examples <= protocol.MAX_EXAMPLES:
            raise errors.ProtocolError(f"a push must stand for 1..{protocol.MAX_EXAMPLES} examples (got {self.examples})")
        if not abs(self.loss) <= protocol.MAX_LOSS:  # also false for NaN
            raise errors.ProtocolError("loss is not a finite number")


PULL = protocol.define(OpSpec(2, "PULL", reply_array=True))
PUSH = protocol.define(OpSpec(3, "PUSH", request=Update, request_array=True, command=True))
PUSH_PULL = protocol.define(OpSpec(14, "PUSH_PULL", request=Update, request_array=True, reply_array=True,
                                   command=True))
PULL_BF16 = protocol.define(OpSpec(15, "PULL_BF16", reply_array=True, dtype=protocol.BFLOAT16))
PUSH_BF16 = protocol.define(OpSpec(16, "PUSH_BF16", request=Update, request_array=True, command=True,
                                   dtype=protocol.BFLOAT16))
PUSH_PULL_BF16 = protocol.define(OpSpec(17, "PUSH_PULL_BF16", request=Update, request_array=True, reply_array=True,
                                        command=True, dtype=protocol.BFLOAT16))
WIRE_FORMATS = tuple(protocol.WIRE_NAMES.values())  # spec.parameterServers.wireFormat
PART_VALUES = 1 << 20  # values of each array in one part of a transfer to a copy catching up (4 MiB)
OPTIMIZER_KEY = "optimizer"  # the checkpoint metadata that names the optimizer


class DenseSlice:
    def __init__(self, shard: Shard, initial: np.ndarray, *, optimizer: str, learning_rate: float,
                 pushes: bool = True, max_gradient_norm: float = float("inf"),
                 max_staleness: int | None = None, wire_format: str = "float32") -> None:
        """initial: the whole flat vector, or just this shard's slice of it; wire_format: the
        format of the pushes it applies (WIRE_FORMATS)."""
        if wire_format not in WIRE_FORMATS:
            raise errors.ConfigError(f"wire format {wire_format!r} is none of {', '.join(WIRE_FORMATS)}")
        layout = shard.layout
        first, last = layout.bounds(shard.index)
        if initial.size not in (layout.total, last - first):
            raise errors.ConfigError(f"initial parameters have {initial.size} values; shard {shard.index} holds "
                                     f"{last - first} of the layout's {layout.total}")
        self.shard = shard
        self.params = np.array(initial[first:last] if initial.size == layout.total else initial, dtype=np.float32)
        self.optimizer = make_optimizer(optimizer, self.params.size, learning_rate=learning_rate)
        self.pushes = pushes
        self.max_gradient_norm = max_gradient_norm
        self.max_staleness = max_staleness
        self._clipped: np.ndarray | None = None  # made on the first clip: most jobs never need it
        self.wire_format = wire_format
        self.codec = bfloat16.Codec(self.params.size)
        self._widened: np.ndarray | None = None  # bfloat16 pushes' float32 buffer, made on the first

    def handlers(self) -> Mapping[OpSpec, Handler]:
        pulls: dict[OpSpec, Handler] = {PULL: self._pull, PULL_BF16: self._pull}
        if not self.pushes:
            return pulls
        pushes = {PUSH: self._push, PUSH_PULL: self._push_pull, PUSH_BF16: self._push, PUSH_PULL_BF16: self._push_pull}
        return {**pulls, **{op: (handler if self._own_format(op) else self._refuse_format)
                            for op, handler in pushes.items()}}

    def repeat_handlers(self) -> Mapping[OpSpec, Handler]:
        if not self.pushes:
            return {}
        return {op: self._pull for op in (PUSH_PULL, PUSH_PULL_BF16) if self._own_format(op)}

    def _own_format(self, op: OpSpec) -> bool:
        return protocol.WIRE_NAMES[op.dtype] == self.wire_format

    def array_values(self) -> int:
        return int(self.params.size)

    def checkpoint_state(self, *, transfer: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return {"params": self.params, **self.optimizer.state()}, {OPTIMIZER_KEY: self.optimizer.name}

    # -- a copy catching up (plugin.Transferable) ------------------------------------------------

    def _state_arrays(self) -> dict[str, np.ndarray]:
        return {"params": self.params, **self.optimizer.state()}

    def transfer_plan(self) -> dict[str, Any]:
        """Parts of PART_VALUES consecutive values of the slice and of each optimizer array:
        every update is elementwise, so a part written over a copy's own values and the
        updates after it give the primary's values."""
        return {"values": int(self.params.size), "optimizer": self.optimizer.name,
                "parts": max(1, -(-self.params.size // PART_VALUES))}

    def read_part(self, plan: dict[str, Any], part: int) -> dict[str, np.ndarray]:
        start = part * PART_VALUES
        return {name: array[start:start + PART_VALUES].copy() for name, array in self._state_arrays().items()}

    def begin_receiving(self, plan: dict[str, Any]) -> None:
        if (plan.get("values"), plan.get("optimizer")) != (self.params.size, self.optimizer.name):
            raise errors.ConfigError(f"shard {self.shard.index}: a transfer of {plan.get('values')} values "
                                     f"({plan.get('optimizer')}) to a slice of {self.params.size} ({self.optimizer.name})")

    def write_part(self, part: int, arrays: dict[str, np.ndarray]) -> None:
        start = part * PART_VALUES
        own = self._state_arrays()
        if arrays.keys() != own.keys():
            raise errors.ProtocolError(f"a part of {sorted(arrays)}, the slice holds {sorted(own)}")
        for name, values in arrays.items():
            target = own[name][start:start + PART_VALUES]
            if values.shape != target.shape or values.dtype != target.dtype:
                raise errors.ProtocolError(f"part {part} of {name}: {values.shape} {values.dtype}, expected "
                                           f"{target.shape} {target.dtype}")
            target[...] = values

    def end_receiving(self) -> None:
        pass

    def restore(self, ckpt: checkpoint.Checkpoint) -> None:
        # Another rule's state would be read as this one's (or be missing): refuse, and
        # leave the checkpoints as they are for the user to resume with their optimizer.
        written_by = ckpt.meta.get(OPTIMIZER_KEY, self.optimizer.name)
        if written_by != self.optimizer.name:
            raise errors.ConfigError(
                f"shard {self.shard.index}: the checkpoints in {self.shard.settings.checkpoint_dir} were written "
                f"with optimizer {written_by!r}, but the job now asks for {self.optimizer.name!r}; resume with "
                f"spec.training.optimizer: {written_by}, or train afresh in another output folder")
        self.params[...] = ckpt.arrays["params"]
        own = self.optimizer.state()
        self.optimizer.load_state({k: v for k, v in ckpt.arrays.items() if k in own})

    # -- ops -------------------------------------------------------------------------------

    def _pull(self, message: Message) -> Answer:
        """The slice in the op's format (a copy: the next push may update it while ZeroMQ sends)."""
        if message.spec.dtype == protocol.BFLOAT16:
            return Answer(array=self.codec.narrow(self.params, np.empty(self.params.size, protocol.BFLOAT16)))
        return Answer(array=self.params.copy())

    def _push(self, message: Message) -> Answer:
        if self.too_stale(message.header.step):
            return Answer(status=Status.STALE)
        grad = self.checked(message)
        if grad.dtype == protocol.BFLOAT16:
            grad = self._widen(grad)
        self.apply(message.header, grad, examples=message.meta.examples, loss=message.meta.loss)
        return Answer()

    def _refuse_format(self, message: Message) -> Answer:
        raise errors.Refused(
            f"{message.spec.name} carries a {protocol.WIRE_NAMES[message.spec.dtype]} gradient, but this job's "
            f"spec.parameterServers.wireFormat is {self.wire_format}: the replica runs another config than "
            f"shard {self.shard.index}; nothing applied")

    def checked(self, message: Message) -> np.ndarray:
        """The pushed gradient, if it has the slice's size; ProtocolError if not."""
        grad = message.array
        if grad is None or grad.size != self.params.size:
            raise errors.ProtocolError(
                f"a push to shard {self.shard.index} must carry {self.params.size} "
                f"{protocol.WIRE_NAMES[message.spec.dtype]} values, header declares {message.header.count}")
        return grad

    def _widen(self, grad: np.ndarray) -> np.ndarray:
        """A bfloat16 gradient in float32, in the slice's one buffer for it (NaN and inf stay
        what they were, so apply's norm check still refuses them)."""
        if self._widened is None:
            self._widened = np.empty_like(self.params)
        return self.codec.widen(grad, self._widened)

    def apply(self, header: protocol.Header, grad: np.ndarray, *, examples: int, loss: float) -> None:
        """One update: grad (bounded, see above) applied by the optimizer; the step advances."""
        self.optimizer.apply(self.params, self._bounded(grad))
        self.shard.applied(header, examples=examples, loss=loss)

    @staticmethod
    def norm(grad: np.ndarray) -> float:
        """grad's L2 norm; Refused if grad has a non-finite value."""
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is what we test for
            squared = float(np.dot(grad, grad))
        if not np.isfinite(squared):
            if not np.isfinite(grad).all():
                raise errors.Refused("gradient has non-finite values; update refused")
            squared = float(np.dot(grad.astype(np.float64), grad.astype(np.float64)))  # finite, but huge
        return squared ** 0.5

    def _bounded(self, grad: np.ndarray) -> np.ndarray:
        """grad, or a copy scaled to max_gradient_norm; Refused if it has a non-finite value."""
        norm = self.norm(grad)
        if norm <= self.max_gradient_norm:
            return grad
        if self._clipped is None:
            self._clipped = np.empty_like(self.params)
        np.multiply(grad, np.float32(self.max_gradient_norm / norm), out=self._clipped)
        self.shard.metrics.clipped.inc()
        return self._clipped

    def _push_pull(self, message: Message) -> Answer:
        status = self._push(message).status
        return dataclasses.replace(self._pull(message), status=status)

    def too_stale(self, pulled_step: int) -> bool:
        """Whether a gradient computed from this step's parameters is more than max_staleness
        updates old."""
        lag = self.shard.step - pulled_step
        if self.max_staleness is None or lag <= self.max_staleness:
            return False
        self.shard.metrics.stale.inc()
        return True
