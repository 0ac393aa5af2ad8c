"""A Downpour replica of a model with embeddings: it moves only the rows a minibatch touches.

Each step:
    dedupe the minibatch's keys (EmbeddingModel.keys)
    SPARSE_PULL their rows from their owners, all shards at once (a row no shard holds yet
        comes back at its deterministic initial value)
    compute the loss and the gradients of the dense parameters and of those rows
    SPARSE_PUSH the rows' gradients to their owners
The dense parameters are pulled and pushed as by any Downpour replica (worker.Worker:
fetchEvery, pushEvery, PUSH_PULL); the rows go every step, since the next minibatch
touches other rows. The dense push comes after the rows' push, so the shard step (and the
chief's evaluation) never counts a step whose rows have not arrived.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from distbelief.runtime import errors, models
from distbelief.runtime.client import ShardGroup
from distbelief.runtime.data import Dataset, batch_indices
from distbelief.runtime.embedding import EmbeddingModel
from distbelief.runtime.metrics import WorkerMetrics
from distbelief.runtime.sparse import RowClient
from distbelief.runtime.worker import Worker, WorkerSettings


class SparseWorker(Worker):
    def __init__(self, settings: WorkerSettings, group: ShardGroup, model: EmbeddingModel, dataset: Dataset,
                 metrics: WorkerMetrics, *, stop: threading.Event | None = None) -> None:
        super().__init__(settings, group, model, dataset, metrics, stop=stop)
        if dataset.ids_train is None:
            raise errors.ConfigError("spec.model.embeddings: the data has no ids")
        self.embedding, self.dataset, self.ids = model, dataset, dataset.ids_train
        self.rows = RowClient(group, model.dim)
        self.indices = batch_indices(len(dataset.y_train), settings.batch_size, self.rng)

    def _gradient(self, out: np.ndarray) -> tuple[float, int]:
        idx = next(self.indices)
        keys, index = self.embedding.keys(self.ids[idx])
        rows, _ = self.rows.pull(keys)
        batch = (self.dataset.x_train[idx], index, self.dataset.y_train[idx])
        loss, _, row_grads = self.embedding.loss_and_grads(self.params, rows, batch, out=out)
        self.rows.push(keys, row_grads)  # a job that ended says DONE to the dense push that follows
        return loss, len(idx)


HeldOut = Callable[[], tuple[models.Model, np.ndarray]]


def held_out_inputs(model: EmbeddingModel, group: ShardGroup, x: np.ndarray, ids: np.ndarray) -> HeldOut:
    """For the chief: the MLP and its held-out inputs, with the rows as the shards hold them now."""
    keys, index = model.keys(ids)
    client = RowClient(group, model.dim)

    def inputs() -> tuple[models.Model, np.ndarray]:
        rows, _ = client.pull(keys)
        return model.mlp, model.inputs(x, rows, index)
    return inputs
