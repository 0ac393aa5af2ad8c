"""A Downpour replica of a model with embeddings: it moves only the rows a minibatch touches.

Each step:
    dedupe the minibatch's keys (EmbeddingModel.keys)
    SPARSE_PULL the rows of the keys it does not hold from their owners, all shards at once
        (a row no shard holds yet comes back at its deterministic initial value)
    compute the loss and the gradients of the dense parameters and of those rows
    add the rows' gradients (and each key's occurrences) to the ones not pushed yet
Every pushEvery steps the accumulated row gradients, one per key, are pushed to their
owners (SPARSE_PUSH), then the dense gradient as by any Downpour replica (worker.Worker).
The dense push comes after the rows' push, so the shard step (and the chief's
evaluation) never counts a step whose rows have not arrived. Every fetchEvery steps,
when the dense parameters are fetched, the rows held are dropped: in between, a key
pulled earlier in the window reuses its row, and only keys not held are pulled (the rows
are not updated locally, as the dense parameters are not).
"""

from __future__ import annotations

import threading
from typing import Iterator

import numpy as np

from distbelief.runtime import errors, jobspec
from distbelief.runtime.algorithms.chief import HeldOut
from distbelief.runtime.algorithms.downpour.worker import Worker
from distbelief.runtime.client.group import ShardGroup
from distbelief.runtime.model import models
from distbelief.runtime.model.data import Dataset, minibatches
from distbelief.runtime.model.embedding import EmbeddingModel
from distbelief.runtime.observe.metrics import WorkerMetrics
from distbelief.runtime.params.rows.row_client import RowClient


class SparseWorker(Worker):
    def __init__(self, training: jobspec.Training, group: ShardGroup, model: EmbeddingModel, dataset: Dataset | None,
                 metrics: WorkerMetrics, *, seed: int | None = None, stop: threading.Event | None = None,
                 batches: Iterator[tuple[np.ndarray, ...]] | None = None) -> None:
        """batches: its (x, y, ids) minibatches when they do not come from the data set (a
        streamed file source)."""
        super().__init__(training, group, model, dataset, metrics, seed=seed, stop=stop, batches=batches)
        self.embedding = model
        self.rows = RowClient(group, model.width)
        self.held = HeldRows(model.width)
        self.unpushed = RowGradients(model.width)

    def _minibatches(self, dataset: Dataset | None) -> Iterator[tuple[np.ndarray, ...]]:
        """Random (x, y, ids) minibatches of the data set's training part."""
        assert dataset is not None, "a replica is given its data set or its minibatches"
        if dataset.ids_train is None:
            raise errors.ConfigError("spec.model.embeddings: the data has no ids")
        return minibatches(dataset, self.training.batch_size, self.rng, with_ids=True)

    def _gradient(self, out: np.ndarray) -> tuple[float, int]:
        x, y, ids = next(self.batches)
        keys, index = self.embedding.keys(ids)
        if self.steps % self.training.fetch_every == 0:
            self.held.clear()
        rows = self._rows(keys)
        loss, _, row_grads = self.embedding.loss_and_grads(self.params, rows, (x, index, y), out=out)
        self.unpushed.add(keys, row_grads, np.bincount(index[index >= 0], minlength=keys.size))
        return loss, len(y)

    def _rows(self, keys: np.ndarray) -> np.ndarray:
        """The rows of keys: the ones held, and the others pulled now (then held too)."""
        missing = self.held.missing(keys)
        if missing.size:
            pulled, _ = self.rows.pull(missing)
            self.held.add(missing, pulled)
        return self.held.get(keys)

    def _push(self, examples: int, loss: float, *, fetch: bool) -> bool:
        keys, grads, occurrences = self.unpushed.take()
        if np.isfinite(loss) and keys.size:  # behind a non-finite loss the dense push drops its part too
            self.rows.push(keys, grads, occurrences)  # a job that ended says DONE to the dense push that follows
        return super()._push(examples, loss, fetch=fetch)


class HeldRows:
    """Rows pulled in the current fetchEvery window, by key (sorted, unique)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.clear()

    def clear(self) -> None:
        self.keys = np.empty(0, dtype=np.int64)
        self.values = np.empty((0, self.dim), dtype=np.float32)

    def missing(self, keys: np.ndarray) -> np.ndarray:
        return keys[~np.isin(keys, self.keys, assume_unique=True)]

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        merged = np.concatenate([self.keys, keys])
        order = np.argsort(merged, kind="stable")
        self.keys, self.values = merged[order], np.concatenate([self.values, values])[order]

    def get(self, keys: np.ndarray) -> np.ndarray:
        return self.values[np.searchsorted(self.keys, keys)]


class RowGradients:
    """Row gradients and key occurrences of the steps since the last push, summed per key."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, keys: np.ndarray, grads: np.ndarray, occurrences: np.ndarray) -> None:
        self.parts.append((keys, grads, occurrences))

    def take(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(unique keys, the sum of each key's gradients, its occurrences); empties the sums."""
        parts, self.parts = self.parts, []
        if len(parts) == 1:
            return parts[0]  # one step's keys are unique already
        if not parts:
            return np.empty(0, np.int64), np.empty((0, self.dim), np.float32), np.empty(0, np.int64)
        keys, inverse = np.unique(np.concatenate([p[0] for p in parts]), return_inverse=True)
        grads = np.zeros((keys.size, self.dim), dtype=np.float32)
        np.add.at(grads, inverse, np.concatenate([p[1] for p in parts]))
        occurrences = np.bincount(inverse, weights=np.concatenate([p[2] for p in parts]), minlength=keys.size)
        return keys, grads, occurrences.astype(np.int64)


def held_out_inputs(model: EmbeddingModel, group: ShardGroup, x: np.ndarray, ids: np.ndarray) -> HeldOut:
    """For the chief: the model to score and its held-out inputs, with the rows as the shards
    hold them now."""
    keys, index = model.keys(ids)
    client = RowClient(group, model.width)

    def inputs() -> tuple[models.Model, np.ndarray]:
        rows, _ = client.pull(keys)
        return model.held_out(x, rows, index)
    return inputs
