"""A primary's state sent to a copy catching up, a part at a time, while the primary serves.

The stream to the copy (forwarding.py) carries, in one order:

    begin   the core's state (step, figures, each peer's last command and its reply) and
            each plugin's plan (plugin.Transferable.transfer_plan: its parts' count and its
            small state), as they are when the copy's JOIN is taken
    ...     every command the primary applies from then on (REPLICATE), and between two of
            them the next part of a plugin's state as it is at that moment (COPY_STATE part)
    end     the primary's step after the last part

The copy applies the commands to its own state from `begin` on and writes each part over
it where it comes in the order: a part's values are then the primary's at the same place
in the order, and the commands after it change both alike (plugin.Transferable says what a
plugin must do for this). After `end` the copy holds the primary's state exactly and may
join the in-sync set. Memory stays bounded: the primary copies out one part at a time (at
most PART_BYTES an array), and sends the next only while the copy has acknowledged most
of what went before (forwarding.Chain.send_parts); the copy writes each part in place.

A transfer that breaks off (its primary gone, the stream silent) leaves the copy's state
mixed: it goes back to its newest checkpoint (Receiver.abort).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.core import Shard
from distbelief.runtime.shard.plugin import Transferable
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import OpSpec

log = logging.getLogger(__name__)

COPY_STATE = protocol.define(OpSpec(33, "COPY_STATE", privileged=True))
PART_BYTES = 4 << 20     # the largest array a part carries (a frame the copies' servers take)
MAX_ARRAYS = 8           # arrays in one part
PartFields = tuple[dict[str, Any], list[np.ndarray | bytes]]


def transferable(shard: Shard) -> list[Transferable]:
    """The shard's plugins, each able to send its state in parts; ConfigError otherwise."""
    for plugin in shard.plugins:
        if not all(hasattr(plugin, m) for m in ("transfer_plan", "read_part", "begin_receiving", "write_part")):
            raise errors.ConfigError(f"shard {shard.index}: {type(plugin).__name__} cannot be copied to a backup "
                                     "(spec.parameterServers.backups)")
    return list(shard.plugins)  # type: ignore[arg-type]


class Sender:
    """One transfer, on the primary: its begin, its parts one by one, its end."""

    def __init__(self, shard: Shard) -> None:
        self.shard, self.plugins = shard, transferable(shard)
        self.plans = [p.transfer_plan() for p in self.plugins]
        self.step = shard.step
        # The parts of plugins whose plan says "first" go before the others' (plugin.Transferable).
        order = sorted(range(len(self.plans)), key=lambda i: not self.plans[i].get("first"))
        self._todo = [(i, part) for i in order for part in range(int(self.plans[i]["parts"]))]
        self._ended = False
        self.parts_sent = 0

    def begin(self) -> PartFields:
        commands = json.dumps(self.shard.last_commands.export()).encode()
        fields = {"kind": "begin", "step": self.step, "meta": self.shard.core_meta(), "plans": self.plans,
                  "arrays": [["commands", "uint8", [len(commands)]]]}
        return fields, [commands]

    def next(self) -> PartFields | None:
        """The next part (read now), then the end, then None."""
        if self._todo:
            plugin, part = self._todo.pop(0)
            arrays = self.plugins[plugin].read_part(self.plans[plugin], part)
            self.parts_sent += 1
            return ({"kind": "part", "plugin": plugin, "part": part,
                     "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()]},
                    [np.ascontiguousarray(a) for a in arrays.values()])
        if not self._ended:
            self._ended = True
            return {"kind": "end", "step": self.shard.step, "parts": self.parts_sent}, []
        return None


class Receiver:
    """One transfer, on the copy catching up."""

    def __init__(self, shard: Shard, *, view: int, stream: str) -> None:
        self.shard, self.view, self.stream = shard, view, stream
        self.plugins = transferable(shard)
        self.parts = 0
        self.begun = self.ended = False

    def begin(self, fields: dict[str, Any], frames: list[memoryview]) -> None:
        plans = fields.get("plans")
        if not isinstance(plans, list) or len(plans) != len(self.plugins):
            raise errors.ProtocolError(f"a transfer of {len(plans or [])} plugins' states to a shard with "
                                       f"{len(self.plugins)}")
        (commands,) = arrays_of(fields, frames).values()
        shard = self.shard
        for plugin, plan in zip(self.plugins, plans):
            plugin.begin_receiving(plan)
        shard.saves.paused = True  # a mixed state is never checkpointed
        shard.step = int(fields["step"])
        shard.take_meta(fields["meta"])
        shard.last_commands.load(json.loads(bytes(commands)))
        shard.metrics.global_step.set(shard.step)
        self.begun = True

    def part(self, fields: dict[str, Any], frames: list[memoryview]) -> None:
        plugin = fields.get("plugin")
        if not isinstance(plugin, int) or not 0 <= plugin < len(self.plugins):
            raise errors.ProtocolError(f"a part of plugin {plugin!r} of {len(self.plugins)}")
        self.plugins[plugin].write_part(int(fields["part"]), arrays_of(fields, frames))
        self.parts += 1

    def end(self, fields: dict[str, Any]) -> None:
        if int(fields.get("parts", -1)) != self.parts:
            raise errors.StateConflict(f"the transfer ended after {self.parts} parts, the primary sent "
                                       f"{fields.get('parts')}")
        for plugin in self.plugins:
            plugin.end_receiving()
        if int(fields["step"]) != self.shard.step:
            raise errors.StateConflict(f"the transfer ended at step {self.shard.step}, the primary's is "
                                       f"{fields['step']}")
        saves = self.shard.saves
        saves.paused, saves.last = False, (saves.last[0], -1)  # the next interval writes this state
        self.ended = True

    def abort(self) -> bool:
        """Back to the newest checkpoint after a transfer that broke off; False if there is none
        (the state then stays mixed, and this copy must never lead with it)."""
        for plugin in self.plugins:
            plugin.end_receiving()
        self.shard.saves.paused = False
        if not self.begun:
            return True
        settings = self.shard.settings
        ckpt = checkpoint.restore_latest(settings.checkpoint_dir, layout=self.shard.layout.hash,
                                         shard=self.shard.index, accept=self.shard.load)
        if ckpt is None:
            return False
        self.shard.take_meta(ckpt.meta)
        return True


def arrays_of(fields: dict[str, Any], frames: list[memoryview]) -> dict[str, np.ndarray]:
    """The arrays a part's frames carry, as its fields describe them (names, dtypes, shapes)."""
    described = fields.get("arrays")
    if not isinstance(described, list) or len(described) != len(frames) or len(frames) > MAX_ARRAYS:
        raise errors.ProtocolError(f"a part describes {described!r} but carries {len(frames)} arrays")
    arrays = {}
    for (name, dtype, shape), frame in zip(described, frames):
        try:
            kind = np.dtype(dtype)
            if kind.hasobject or kind.kind not in "biuf":
                raise TypeError(dtype)
            count = int(np.prod(shape)) if shape else 1
            if len(frame) != count * kind.itemsize:
                raise ValueError(f"{len(frame)} bytes for {count} values")
            arrays[str(name)] = np.frombuffer(frame, dtype=kind).reshape(shape)
        except (TypeError, ValueError) as exc:
            raise errors.ProtocolError(f"part array {name!r}: {exc}") from exc
    return arrays
