"""What is attached to the shard core (core.py) from above, as the core sees it.

    ShardPlugin   an algorithm's part of a shard: some ops (each op has one owner on a
                  shard) and some state, which the core saves in its checkpoints and gives
                  back on restore. A handler gets the parsed request (protocol.Message) and
                  returns an Answer; the core adds the header with the shard's step, and
                  keeps the reply of a command for resends.
    UpdateHook    an algorithm's view of the updates a shard applies: whether a replica
                  that says HELLO may train now, each update as it is applied, and the
                  figures it adds to STATS and to the chief's history (Downpour's:
                  algorithms/downpour/updates.py)
    Transferable  a plugin whose state a copy catching up receives a part at a time
                  while commands go on (copies/transfer.py): every plugin of a shard
                  with backups
    Replication   the shard's copies (copies/replication.py): whether this copy serves
                  clients, the commands it forwards to its backups, when a reply may
                  leave, the copies' own ops. SingleCopy, a shard without backups, is the
                  core's default.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from distbelief.runtime.shard import checkpoint
from distbelief.runtime.transport.interface import Incoming, Link
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Header, Message, OpSpec, Status


@dataclasses.dataclass(frozen=True)
class Answer:
    """What a handler returns; the core adds the header (the shard's step) and sends it."""

    meta: protocol.Payload | None = None
    array: np.ndarray | None = None
    status: int = Status.OK


Handler = Callable[[Message], Answer]


class ShardPlugin(Protocol):
    """An algorithm's part of a shard: the ops it serves and its state in checkpoints."""

    def handlers(self) -> Mapping[OpSpec, Handler]: ...

    def repeat_handlers(self) -> Mapping[OpSpec, Handler]:
        """Commands whose reply is not kept for resends, and what a resend gets instead."""
        ...

    def array_values(self) -> int:
        """The longest float32 array a request of this plugin carries."""
        ...

    def checkpoint_state(self, *, transfer: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The arrays and metadata of the shard's next checkpoint. A plugin may write files of
        its own that the metadata names (params/rows/sparse.py's rows); with transfer (a copy catching up
        on another machine) everything is in the arrays and nothing is written."""
        ...

    def restore(self, ckpt: checkpoint.Checkpoint) -> None: ...


class UpdateHook(Protocol):
    """An algorithm's view of the updates a shard applies. A peer is (its authenticated user,
    its connection's routing id), as the core tells them apart."""

    def admit(self, peer: tuple) -> bool:
        """Whether a replica that says HELLO may train now (no: it is told to WAIT)."""
        ...

    def applied(self, peer: tuple, header: Header, *, examples: int, loss: float) -> None:
        """An update from peer was applied, computed from header.step; the shard's step is
        still the one before it."""
        ...

    def figures(self) -> dict[str, Any]:
        """What it adds to STATS and to the chief's record of training."""
        ...


class Transferable(Protocol):
    """A plugin whose state a copy catching up receives in parts while the primary goes on
    serving (copies/transfer.py). The primary reads part i between two commands; the copy
    catching up applies every command from the start of the transfer on, in the same order,
    and writes each part over its own state at the same place in that order. So a command
    may touch a part only through that part's own state (elementwise, as the dense
    optimizers do), or, while receiving, must skip the parts not received yet (the sparse
    rows, whose parts are sets of keys). Small state that every command may touch goes in
    the plan, read first. A plugin whose commands write into another plugin's state says
    "first": true in its plan, and its parts are sent before any other plugin's (the held
    gradients of partitioned jobs, which APPLY_HELD writes into the slice)."""

    def transfer_plan(self) -> dict[str, Any]:
        """How the state divides into parts ("parts": their count), and the small state, as JSON."""
        ...

    def read_part(self, plan: dict[str, Any], part: int) -> dict[str, np.ndarray]:
        """Part `part` of the state now: copies, a bounded size each."""
        ...

    def begin_receiving(self, plan: dict[str, Any]) -> None:
        """A transfer starts: take the plan's small state; commands come from now on."""
        ...

    def write_part(self, part: int, arrays: dict[str, np.ndarray]) -> None: ...

    def end_receiving(self) -> None:
        """Every part is written: the state is the primary's."""
        ...


RawHandler = Callable[[Header, Incoming], list]  # an op that reads its own frames -> the reply's frames


class Replication(Protocol):
    """What the core asks of the replication between a shard's copies."""

    extra_frames: int  # frames a forwarded request carries beyond a client's
    frame_bytes: int   # the largest frame a copy sends another (beyond the plugins' arrays)

    def check_serving(self, spec: OpSpec) -> None:
        """Raise NotPrimary unless this copy serves clients."""
        ...

    def serves_clients(self) -> bool:
        """Whether this copy answers the replicas now (the primary; not a backup applying
        what the primary forwards, nor a copy catching up)."""
        ...

    def replicate(self, incoming: Incoming) -> None:
        """A command was just applied: forward it to the backups (without waiting for them)."""
        ...

    def reply_tag(self) -> Any:
        """What a reply given now waits for (None: nothing, it may leave at once)."""
        ...

    def released(self, tag: Any) -> bool | None:
        """Whether a reply tagged so may leave now (every copy in sync has what it answers),
        must wait (False), or must never leave (None: this copy stopped being primary)."""
        ...

    def links(self) -> Sequence[Link]:
        """What the serving loop waits on beside its server (the backups' answers)."""
        ...

    def accepting(self) -> bool:
        """False while too much is forwarded and not acknowledged: take no request."""
        ...

    def raw_ops(self) -> Mapping[OpSpec, RawHandler]:
        """The copies' own ops, which read their own frames and skip the serving check."""
        ...

    def tick(self) -> None:
        """Called by the serving loop between requests."""
        ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, Any]:
        """This copy's figures, for STATS."""
        ...


class SingleCopy:
    """A shard without backups: serves every client, replicates nothing."""

    extra_frames = 0
    frame_bytes = 0

    def check_serving(self, spec: OpSpec) -> None:
        pass

    def serves_clients(self) -> bool:
        return True

    def replicate(self, incoming: Incoming) -> None:
        pass

    def reply_tag(self) -> Any:
        return None

    def released(self, tag: Any) -> bool | None:
        return True

    def links(self) -> Sequence[Link]:
        return ()

    def accepting(self) -> bool:
        return True

    def raw_ops(self) -> Mapping[OpSpec, RawHandler]:
        return {}

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}
