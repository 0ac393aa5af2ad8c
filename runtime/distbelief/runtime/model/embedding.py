"""The model of a job with spec.model.embeddings: embedded categorical ids feeding the MLP,
and (by default) beside it each id's own linear weight: a wide and deep model.

Each example's id in field f has a row, looked up by its key:

    key = f << 56 | id                      hashBuckets = 0: collisionless (ids < 2**56)
    key = f << 56 | hash(id) % hashBuckets  otherwise: ids of a field share hashBuckets rows

A row holds dim embedding values and, with the wide part (spec.model.embeddings.wide,
the default), `wide` more: the id's linear weights, one per class. A missing id (-1)
contributes zeros and no key. The
embedding values of all fields are concatenated after the dense features x, and the
result is the input of an ordinary Mlp (models.py), whose parameters are the dense,
sharded ones (the deep part); the wide values of an example's ids are summed and added to
the Mlp's logits (the wide part: one-hot logistic regression over the ids, Cheng et al.,
"Wide & Deep Learning for Recommender Systems", 2016). The rows live on the shards
(params/rows/sparse.py); a replica gets only the rows of its minibatch's keys, and
loss_and_grads returns the gradient of exactly those rows.

Why the wide part, and the rows' lazy L2 (rowtable.py): on click data shaped like real
logs (most ids seen once or twice), an embedding and an MLP alone memorise the rare ids
within an epoch or two and fall far below logistic regression on held-out data; the wide
part carries what logistic regression learns, and L2 on the rows keeps both from
memorising (docs/benchmarks.md, "Click data shaped like real logs").
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from distbelief.runtime import errors, jobspec
from distbelief.runtime.model import models
from distbelief.runtime.wire.rowkeys import mix

FIELD_SHIFT = 56

# (dense features, key index per field, labels): index[i, f] is the position of example
# i's key for field f among the batch's unique keys, -1 where the id is missing.
SparseBatch = tuple[np.ndarray, np.ndarray, np.ndarray]


class EmbeddingModel:
    def __init__(self, mlp: models.Mlp, *, dense_features: int, fields: int, dim: int, hash_buckets: int = 0,
                 wide: int = 0) -> None:
        """dim: embedding values per row; wide: linear weights per row (0: no wide part)."""
        self.mlp, self.dense_features, self.fields, self.dim = mlp, dense_features, fields, dim
        self.hash_buckets, self.wide = hash_buckets, wide
        self.width = dim + wide  # values per row, as the shards hold them
        self.classes = int(mlp.shapes[-1][1][0])
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
        """The MLP's input: x, then each field's embedding values (zeros for a missing id)."""
        embedded = np.zeros((*index.shape, self.dim), dtype=np.float32)
        present = index >= 0
        embedded[present] = rows[index[present], :self.dim]
        return np.concatenate([x, embedded.reshape(len(x), -1)], axis=1)

    def offsets(self, rows: np.ndarray, index: np.ndarray) -> np.ndarray | None:
        """What the wide part adds to each example's logits [n, classes]: the sum of its ids'
        wide values; None without a wide part."""
        if not self.wide:
            return None
        present = index >= 0
        linear = np.zeros((*index.shape, self.wide), dtype=np.float32)
        linear[present] = rows[index[present], self.dim:]
        return linear.sum(axis=1)

    def loss_and_grads(self, params: np.ndarray, rows: np.ndarray, batch: SparseBatch,
                       out: np.ndarray | None = None) -> tuple[float, np.ndarray, np.ndarray]:
        """loss, its gradient w.r.t. the dense params, and w.r.t. rows (the batch's only)."""
        x, index, y = batch
        loss, grad, d_inputs, d_logits = self.mlp.backward_offset(
            params, (self.inputs(x, rows, index), y), self.offsets(rows, index), out, input_grad=True)
        assert d_inputs is not None
        present = index >= 0
        row_grads = np.zeros_like(rows)
        d_embedded = d_inputs[:, self.dense_features:].reshape(*index.shape, self.dim)
        np.add.at(row_grads[:, :self.dim], index[present], d_embedded[present])
        if self.wide:
            d_wide = np.broadcast_to(d_logits[:, None, :], (*index.shape, self.wide))
            np.add.at(row_grads[:, self.dim:], index[present], d_wide[present])
        return loss, grad, row_grads

    def held_out(self, x: np.ndarray, rows: np.ndarray, index: np.ndarray) -> tuple[models.Model, np.ndarray]:
        """What the chief scores: a model over inputs, and the inputs, built from the rows of
        the held-out examples' keys. With a wide part the inputs carry its logit offsets in
        their last columns, which the scored model adds to the MLP's logits."""
        inputs = self.inputs(x, rows, index)
        offsets = self.offsets(rows, index)
        if offsets is None:
            return self.mlp, inputs
        return OffsetLogits(self.mlp), np.concatenate([inputs, offsets], axis=1)


class OffsetLogits:
    """An Mlp scored on inputs whose last `classes` columns are added to its logits (the wide
    part's sums, EmbeddingModel.held_out): predict, logits and loss as models.evaluate and
    models.held_out_auc read them."""

    def __init__(self, mlp: models.Mlp) -> None:
        self.mlp, self.shapes = mlp, mlp.shapes
        self.classes = int(mlp.shapes[-1][1][0])

    def logits(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        return self.mlp.logits(params, x[:, :-self.classes]) + x[:, -self.classes:]

    def predict(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        return np.argmax(self.logits(params, x), axis=1)

    def loss(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        loss = models.softmax_cross_entropy_inplace(self.logits(params, x), y)
        return loss + self.mlp.l2_penalty(self.mlp._layers(params)) if self.mlp.l2 else loss

    def init_params(self, seed: int) -> np.ndarray:
        return self.mlp.init_params(seed)

    def loss_and_grad(self, params: np.ndarray, batch: models.Batch,
                      out: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        x, y = batch
        loss, grad, _, _ = self.mlp.backward_offset(params, (x[:, :-self.classes], y), x[:, -self.classes:], out)
        return loss, grad


class DataShape(Protocol):
    """What the model's shape takes from the data: a loaded data set (data.Dataset) or the
    files the replicas stream (files.FileSet)."""

    @property
    def n_features(self) -> int: ...

    @property
    def fields(self) -> int: ...

    @property
    def n_classes(self) -> int: ...


def build(spec: jobspec.Model, dataset: DataShape) -> EmbeddingModel:
    """The model of a spec.model with embeddings, over data with ids."""
    if spec.embeddings is None:
        raise errors.ConfigError("spec.model.embeddings: not set")
    if dataset.fields == 0:
        raise errors.ConfigError("spec.model.embeddings: the data has no ids to embed (an npz array 'ids', "
                                 "a synthetic-ctr: source, or a file source's spec.data.ids)")
    if spec.entrypoint:
        raise errors.ConfigError("spec.model.embeddings: not available with spec.model.entrypoint")
    dim = spec.embeddings.dim
    inputs = dataset.n_features + dataset.fields * dim
    mlp = models.build_model(dataclasses.replace(spec, embeddings=None), inputs, dataset.n_classes)
    assert isinstance(mlp, models.Mlp)
    return EmbeddingModel(mlp, dense_features=dataset.n_features, fields=dataset.fields, dim=dim,
                          hash_buckets=spec.embeddings.hash_buckets,
                          wide=wide_values(dataset.n_classes) if spec.embeddings.wide else 0)


def wide_values(classes: int) -> int:
    """Linear weights per row of the wide part: one per class, as softmax regression has.
    (Two classes could do with one, added to the second logit; the figures in
    docs/benchmarks.md are of one per class.)"""
    return classes
