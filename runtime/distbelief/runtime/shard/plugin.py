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
    Replication   the shard's copies (copies/replication.py): whether this copy serves
                  clients, the commands it forwards to its backups, the copies' own ops.
                  SingleCopy, a shard without backups, is the core's default.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from distbelief.runtime.shard import checkpoint
from distbelief.runtime.transport.interface import Incoming
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


RawHandler = Callable[[Header, Incoming], list]  # an op that reads its own frames -> the reply's frames


class Replication(Protocol):
    """What the core asks of the replication between a shard's copies."""

    extra_frames: int  # frames a forwarded request carries beyond a client's

    def check_serving(self, spec: OpSpec) -> None:
        """Raise NotPrimary unless this copy serves clients."""
        ...

    def replicate(self, incoming: Incoming) -> None:
        """A command was just applied: forward it to the backups; return once they have it."""
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

    def check_serving(self, spec: OpSpec) -> None:
        pass

    def replicate(self, incoming: Incoming) -> None:
        pass

    def raw_ops(self) -> Mapping[OpSpec, RawHandler]:
        return {}

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}
