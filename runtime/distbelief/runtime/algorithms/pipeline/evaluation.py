"""The chief's scorer of a partitioned model: one stage's parameters at a time.

A model that is partitioned because it does not fit one pod does not fit the chief's
either (it runs in shard 0's pod). So the chief pulls one stage's parameters, pushes the
whole held-out set through that stage, and goes on to the next, holding at most the
largest stage and the held-out set's activations. The stages are pulled one after the
other, so under training they are a few milliseconds apart in age, as a replica's pulls
of different shards are.

The final parameters (params.npz) are written the same way, stage by stage: they are
pulled again just before DONE, so a step applied between the last evaluation and the
save may be in them.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from distbelief.runtime.algorithms.chief import Score
from distbelief.runtime.client.group import ShardGroup
from distbelief.runtime.model import models
from distbelief.runtime.model.data import Dataset
from distbelief.runtime.model.stages import Plan, Stage
from distbelief.runtime.params.dense_client import Float32Dense


class StagedModel:
    def __init__(self, plan: Plan, groups: Sequence[ShardGroup], dataset: Dataset, max_eval_examples: int) -> None:
        """groups: for each stage, a ShardGroup of the shards holding it."""
        self.plan, self.groups = plan, list(groups)
        self.x_test = dataset.x_test[:max_eval_examples]
        self.y_test = dataset.y_test[:max_eval_examples]
        self.two_classes = dataset.n_classes == 2
        self._buffer = np.empty(max(stage.size for stage in plan.stages), dtype=np.float32)

    def score(self) -> Score | None:
        activations, penalty, step = self.x_test, 0.0, 0
        for stage, params, step_now in self._stages():
            if params is None:
                return None
            step = step_now if stage.index == 0 else step  # shard 0's, as the unpartitioned chief reports
            activations = stage.forward(params, activations)[-1]
            penalty += stage.model.l2_penalty(stage.layers(params))
        logits = activations
        accuracy = float(np.mean(np.argmax(logits, axis=1) == self.y_test))
        auc = models.auc(np.diff(logits, axis=1)[:, 0], self.y_test) if self.two_classes else None
        loss = models.softmax_cross_entropy_inplace(logits, self.y_test) + penalty
        return Score(step, loss, accuracy, auc)

    def save(self, path: str) -> None:
        models.save_params(path, self._tensors())

    def close(self) -> None:
        for group in self.groups:
            group.close()

    def _stages(self) -> Iterator[tuple[Stage, np.ndarray | None, int]]:
        """(stage, its parameters now or None if the job is done, its first shard's step),
        one stage at a time, in the one buffer."""
        for stage, group in zip(self.plan.stages, self.groups):
            params = self._buffer[:stage.size]
            replies = Float32Dense(group).pull(params)
            if any(r.done for r in replies):
                yield stage, None, 0
                return
            yield stage, params, replies[0].header.step

    def _tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        for stage, params, _ in self._stages():
            if params is None:
                return
            names = [name for name, _ in stage.model.shapes[2 * stage.first:2 * stage.stop]]
            views = [array for layer in stage.layers(params) for array in layer]
            yield from zip(names, views)
