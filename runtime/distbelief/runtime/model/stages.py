"""The cut of a model into consecutive stages, and what one stage computes.

The cut is a pure function of the model's layer shapes and the partition count, so every
role derives the same one without talking; the layout (which shards hold which stage)
follows from it, and its hash catches a peer that cut differently. Stages are balanced by
their layers' parameter counts, which for fully connected layers is also their compute.

A stage is a run of the MLP's layers. It computes the forward pass of its layers on the
activations it gets, and on the way back turns the gradient w.r.t. its output into its
parameters' gradient and the gradient w.r.t. its input (for the stage before it). The
last stage ends in the loss. Each stage adds the L2 term of its own weights, so the
stages' gradients, concatenated, are the whole model's gradient.

A step's minibatch may go through the stages as micro-batches (spec.model.microBatches):
the last stage weighs each micro-batch's mean cross-entropy by its share of the step's
rows, and each stage adds its L2 term with one micro-batch only, so the micro-batches'
gradients add up to the whole minibatch's.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.model.models import Mlp, softmax_cross_entropy_inplace

MAX_PARTITIONS = 16


def layer_sizes(model: Mlp) -> list[int]:
    """Parameters per layer (weight and bias)."""
    return [int(np.prod(w)) + int(np.prod(b)) for (_, w), (_, b) in zip(model.shapes[0::2], model.shapes[1::2])]


def cut(sizes: list[int], partitions: int) -> list[int]:
    """The first layer of each stage: consecutive runs minimising the largest stage's size
    (ties go to the earliest cut, so the answer is unique)."""
    if not 1 <= partitions <= len(sizes):
        raise errors.ConfigError(f"spec.model.partitions: {partitions} stages need at least as many layers; "
                                 f"the model has {len(sizes)}")
    prefix = np.concatenate([[0], np.cumsum(sizes)])

    @functools.lru_cache(maxsize=None)
    def best(start: int, parts: int) -> tuple[int, tuple[int, ...]]:
        """(largest stage, firsts) for layers start.. split into parts stages."""
        if parts == 1:
            return int(prefix[-1] - prefix[start]), (start,)
        options = []
        for stop in range(start + 1, len(sizes) - parts + 2):
            rest, firsts = best(stop, parts - 1)
            options.append((max(int(prefix[stop] - prefix[start]), rest), (start, *firsts)))
        return min(options)

    return list(best(0, partitions)[1])


@dataclasses.dataclass(frozen=True)
class Stage:
    """Layers [first, stop) of an MLP, and their range [offset, offset + size) of its flat vector."""

    model: Mlp
    index: int
    first: int
    stop: int
    offset: int
    size: int

    @property
    def is_first(self) -> bool:
        return self.first == 0

    @property
    def is_last(self) -> bool:
        return self.stop == self.model.depth

    @property
    def input_width(self) -> int:
        return self.model.shapes[2 * self.first][1][0]

    @property
    def output_width(self) -> int:
        return self.model.shapes[2 * self.stop - 2][1][1]

    def layers(self, flat: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """(weight, bias) views of this stage's layers in its own flat vector."""
        views, offset = [], 0
        for (_, w_shape), (_, b_shape) in zip(self.model.shapes[2 * self.first:2 * self.stop:2],
                                              self.model.shapes[2 * self.first + 1:2 * self.stop:2]):
            w_size, b_size = int(np.prod(w_shape)), int(np.prod(b_shape))
            views.append((flat[offset:offset + w_size].reshape(w_shape),
                          flat[offset + w_size:offset + w_size + b_size]))
            offset += w_size + b_size
        return views

    def forward(self, params: np.ndarray, x: np.ndarray) -> list[np.ndarray]:
        """The input and each layer's output; the last is what the next stage gets."""
        return self.model.forward_layers(self.layers(params), x, self.first)

    def backward(self, params: np.ndarray, activations: list[np.ndarray], upstream: np.ndarray,
                 out: np.ndarray, *, share: float = 1.0, l2: bool = True) -> tuple[float, np.ndarray | None]:
        """Write this stage's gradient into out. upstream: the labels for the last stage,
        else d(loss)/d(this stage's output). share: the micro-batch's fraction of its step's
        rows; l2: add the L2 term (once a step). Returns (this stage's part of the loss: the
        weighed cross-entropy in the last stage plus the L2 term, d(loss)/d(input) or None
        for the first stage)."""
        layers, grads = self.layers(params), self.layers(out)
        output = activations[-1]
        if self.is_last:
            delta, loss = output, share * softmax_cross_entropy_inplace(output, upstream)
            if share != 1.0:
                delta *= np.float32(share)
        else:
            delta, loss = np.array(upstream, dtype=np.float32), 0.0
            self.model.activation_grad(delta, output)
        input_grad = self.model.backward_layers(layers, grads, activations[:-1], delta,
                                                input_grad=not self.is_first)
        return loss + (self.model.add_l2(layers, grads) if l2 else 0.0), input_grad


@dataclasses.dataclass(frozen=True)
class Plan:
    """The stages of one model for one partition count."""

    stages: tuple[Stage, ...]

    @property
    def boundaries(self) -> list[int]:
        """Where in the flat vector each stage after the first begins."""
        return [stage.offset for stage in self.stages[1:]]


def plan(model: object, partitions: int) -> Plan:
    """The stages of model for `partitions` partitions; ConfigError for a model that cannot be cut."""
    if not isinstance(model, Mlp):
        raise errors.ConfigError("spec.model.partitions > 1 needs a built-in mlp model")
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise errors.ConfigError(f"spec.model.partitions must be within 1..{MAX_PARTITIONS} (got {partitions})")
    sizes = layer_sizes(model)
    firsts = cut(sizes, partitions)
    stops = [*firsts[1:], len(sizes)]
    stages, offset = [], 0
    for index, (first, stop) in enumerate(zip(firsts, stops)):
        size = sum(sizes[first:stop])
        stages.append(Stage(model, index, first, stop, offset, size))
        offset += size
    return Plan(tuple(stages))
