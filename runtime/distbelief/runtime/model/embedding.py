"""The model of a job with spec.model.embeddings: embedded categorical ids feeding the MLP.

Each example's id in field f becomes a row of dim values, looked up by its key:

    key = f << 56 | id                      hashBuckets = 0: collisionless (ids < 2**56)
    key = f << 56 | hash(id) % hashBuckets  otherwise: ids of a field share hashBuckets rows

A missing id (-1) contributes a zero vector and no key. The rows of all fields are
concatenated after the dense features x, and the result is the input of an ordinary Mlp
(models.py), whose parameters are the dense, sharded ones. The rows live on the shards
(params/rows/sparse.py); a replica gets only the rows of its minibatch's keys, and
loss_and_grads returns the gradient of exactly those rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distbelief.runtime import errors, jobspec
from distbelief.runtime.model import models
from distbelief.runtime.model.data import Dataset
from distbelief.runtime.wire.rowkeys import mix

FIELD_SHIFT = 56

# (dense features, key index per field, labels): index[i, f] is the position of example
# i's key for field f among the batch's unique keys, -1 where the id is missing.
SparseBatch = tuple[np.ndarray, np.ndarray, np.ndarray]


class EmbeddingModel:
    def __init__(self, mlp: models.Mlp, *, dense_features: int, fields: int, dim: int, hash_buckets: int = 0) -> None:
        self.mlp, self.dense_features, self.fields, self.dim = mlp, dense_features, fields, dim
        self.hash_buckets = hash_buckets
        self.shapes = mlp.shapes

    def init_params(self, seed: int) -> np.ndarray:
        return self.mlp.init_params(seed)

    def keys(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The unique keys of a batch's ids [n, fields], and each id's index among them."""
        present = ids >= 0
        values = ids if self.hash_buckets == 0 else (mix(ids) % np.uint64(self.hash_buckets)).astype(np.int64)
        fields = np.arange(self.fields, dtype=np.int64) << FIELD_SHIFT
        unique, inverse = np.unique((values | fields[None, :])[present], return_inverse=True)
        index = np.full(ids.shape, -1, dtype=np.int64)
        index[present] = inverse
        return unique, index

    def inputs(self, x: np.ndarray, rows: np.ndarray, index: np.ndarray) -> np.ndarray:
        """The MLP's input: x, then each field's row (zeros for a missing id)."""
        embedded = np.zeros((*index.shape, self.dim), dtype=np.float32)
        present = index >= 0
        embedded[present] = rows[index[present]]
        return np.concatenate([x, embedded.reshape(len(x), -1)], axis=1)

    def loss_and_grads(self, params: np.ndarray, rows: np.ndarray, batch: SparseBatch,
                       out: np.ndarray | None = None) -> tuple[float, np.ndarray, np.ndarray]:
        """loss, its gradient w.r.t. the dense params, and w.r.t. rows (the batch's only)."""
        x, index, y = batch
        loss, grad, d_inputs = self.mlp.backward(params, (self.inputs(x, rows, index), y), out, input_grad=True)
        assert d_inputs is not None
        d_embedded = d_inputs[:, self.dense_features:].reshape(*index.shape, self.dim)
        present = index >= 0
        row_grads = np.zeros_like(rows)
        np.add.at(row_grads, index[present], d_embedded[present])
        return loss, grad, row_grads


def build(spec: jobspec.Model, dataset: Dataset) -> EmbeddingModel:
    """The model of a spec.model with embeddings, over a data set with ids."""
    if spec.embeddings is None:
        raise errors.ConfigError("spec.model.embeddings: not set")
    if dataset.fields == 0:
        raise errors.ConfigError("spec.model.embeddings: the data has no ids to embed (an npz array 'ids', "
                                 "or a synthetic-ctr: source)")
    if spec.entrypoint:
        raise errors.ConfigError("spec.model.embeddings: not available with spec.model.entrypoint")
    dim = spec.embeddings.dim
    inputs = dataset.n_features + dataset.fields * dim
    mlp = models.build_model(dataclasses.replace(spec, embeddings=None), inputs, dataset.n_classes)
    assert isinstance(mlp, models.Mlp)
    return EmbeddingModel(mlp, dense_features=dataset.n_features, fields=dataset.fields, dim=dim,
                          hash_buckets=spec.embeddings.hash_buckets)
