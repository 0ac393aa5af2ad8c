"""The replica's side of the dense slices (dense.py): pull, push and push_and_pull of a
flat vector, each shard its slice, over a ShardGroup's request().

    Float32Dense    float32 on the wire (spec.parameterServers.wireFormat: float32)
    Bfloat16Dense   bfloat16 on the wire, for the caller's float32 arrays
    of(group, wire_format)   the one a job's wire format asks for

Pulls land straight in the caller's array (or, in bfloat16, in one half-size buffer
widened into it); a push's steps[i] is the step pulled from the group's i-th shard.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from distbelief.runtime.client.group import Reply, ShardGroup
from distbelief.runtime.params import dense
from distbelief.runtime.wire import bfloat16, protocol


class Float32Dense:
    """A group's dense slices with float32 on the wire."""

    def __init__(self, group: ShardGroup) -> None:
        self.group = group

    def pull(self, out: np.ndarray) -> list[Reply]:
        """Fill out (the group's flat vector) with every shard's slice; the replies carry steps."""
        return self.group.request(dense.PULL, receive_into=out)

    def push(self, grad: np.ndarray, *, steps: Sequence[int], examples: int, loss: float) -> list[Reply]:
        """Send each shard its slice of grad; steps[i] is the step pulled from the group's i-th shard."""
        return self.group.request(dense.PUSH, array=grad, steps=steps, meta=dense.Update(examples=examples, loss=loss))

    def push_and_pull(self, grad: np.ndarray, out: np.ndarray, *, steps: Sequence[int], examples: int,
                      loss: float) -> list[Reply]:
        """push, then fill out with the parameters that include it: one round trip, not two."""
        return self.group.request(dense.PUSH_PULL, array=grad, receive_into=out, steps=steps,
                                  meta=dense.Update(examples=examples, loss=loss))


class Bfloat16Dense:
    """A group's pull, push and push_and_pull with bfloat16 arrays on the wire
    (spec.parameterServers.wireFormat: bfloat16), for the caller's float32 arrays.

    Pulls land in one half-size buffer and are widened into the caller's array. A pushed
    gradient is narrowed into the first half of its own memory, which the replica has no
    further use for (it zeroes or overwrites its gradient after a push): so this buffer
    is the only one beyond the replica's float32 arrays."""

    def __init__(self, group: ShardGroup) -> None:
        self.group = group
        self.codec = bfloat16.Codec(group.values)
        self.wire = np.empty(group.values, dtype=protocol.BFLOAT16)

    def pull(self, out: np.ndarray) -> list[Reply]:
        replies = self.group.request(dense.PULL_BF16, receive_into=self.wire)
        self.codec.widen(self.wire, out)
        return replies

    def push(self, grad: np.ndarray, *, steps: Sequence[int], examples: int, loss: float) -> list[Reply]:
        """As Float32Dense.push; grad is left holding its bfloat16 form, not its values."""
        return self.group.request(dense.PUSH_BF16, array=self._narrowed(grad), steps=steps,
                                  meta=dense.Update(examples=examples, loss=loss))

    def push_and_pull(self, grad: np.ndarray, out: np.ndarray, *, steps: Sequence[int], examples: int,
                      loss: float) -> list[Reply]:
        """As Float32Dense.push_and_pull; grad is left holding its bfloat16 form, not its values."""
        replies = self.group.request(dense.PUSH_PULL_BF16, array=self._narrowed(grad), receive_into=self.wire,
                                     steps=steps, meta=dense.Update(examples=examples, loss=loss))
        self.codec.widen(self.wire, out)
        return replies

    def _narrowed(self, grad: np.ndarray) -> np.ndarray:
        return self.codec.narrow(grad, grad.view(protocol.BFLOAT16)[:grad.size])


def of(group: ShardGroup, wire_format: str) -> Float32Dense | Bfloat16Dense:
    """The dense calls in a job's wire format (spec.parameterServers.wireFormat)."""
    return Bfloat16Dense(group) if wire_format == "bfloat16" else Float32Dense(group)
