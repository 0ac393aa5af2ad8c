"""The interface between the shard core (shard.py) and what an algorithm attaches to it.

A plugin serves some ops (each op has one owner on a shard) and keeps some state, which
the core saves in its checkpoints and gives back on restore. A handler gets the parsed
request (protocol.Message) and returns an Answer; the core adds the header with the
shard's step, and keeps the reply of a command for resends.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from distbelief.runtime import checkpoint
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Message, OpSpec, Status


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
        its own that the metadata names (sparse.py's rows); with transfer (a copy catching up
        on another machine) everything is in the arrays and nothing is written."""
        ...

    def restore(self, ckpt: checkpoint.Checkpoint) -> None: ...
