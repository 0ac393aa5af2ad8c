"""The embedding model: keys of ids, inputs, and its gradients (finite differences)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from distbelief.runtime import errors, jobspec
from distbelief.runtime.model import data, embedding, models
from distbelief.runtime.model.embedding import EmbeddingModel

DIM, FIELDS, DENSE = 3, 4, 2


def _model(hash_buckets: int = 0) -> EmbeddingModel:
    mlp = models.Mlp(DENSE + FIELDS * DIM, 2, hidden=(5,), activation="tanh")
    return EmbeddingModel(mlp, dense_features=DENSE, fields=FIELDS, dim=DIM, hash_buckets=hash_buckets)


def test_keys_are_unique_per_field_and_id_and_skip_missing_ids() -> None:
    ids = np.array([[1, 1, -1, 7], [1, 2, 5, 7]], dtype=np.int64)
    keys, index = _model().keys(ids)
    assert keys.size == 5  # (field, id): (0,1) (1,1) (1,2) (2,5) (3,7); the missing id has none
    assert index[0, 2] == -1
    assert index[0, 0] == index[1, 0] and index[0, 3] == index[1, 3]
    assert index[0, 1] != index[0, 0]  # the same id in another field is another row
    np.testing.assert_array_equal(keys[index[1]] >> embedding.FIELD_SHIFT, np.arange(FIELDS))
    np.testing.assert_array_equal(keys[index[1]] & ((1 << embedding.FIELD_SHIFT) - 1), [1, 2, 5, 7])


def test_hash_buckets_bound_the_rows_of_a_field() -> None:
    ids = np.arange(10_000, dtype=np.int64).reshape(-1, 1).repeat(FIELDS, axis=1)
    keys, _ = _model(hash_buckets=50).keys(ids)
    assert keys.size == FIELDS * 50


def test_gradients_match_finite_differences_for_rows_and_dense_params() -> None:
    rng = np.random.default_rng(0)
    model = _model()
    ids = rng.integers(-1, 6, (8, FIELDS))
    keys, index = model.keys(ids)
    x = rng.standard_normal((8, DENSE)).astype(np.float32)
    y = rng.integers(0, 2, 8)
    params = model.init_params(1) + rng.standard_normal(models.num_params(model)).astype(np.float32) * 0.1
    rows = rng.standard_normal((keys.size, DIM)).astype(np.float32)
    _, grad, row_grads = model.loss_and_grads(params, rows, (x, index, y))
    assert row_grads.shape == (keys.size, DIM)

    def loss(p: np.ndarray, r: np.ndarray) -> float:
        return model.mlp.loss(p, model.inputs(x, r, index), y)

    eps = 1e-2
    for k, j in [(0, 0), (keys.size // 2, 1), (keys.size - 1, 2)]:
        plus, minus = rows.astype(np.float64).copy(), rows.astype(np.float64).copy()
        plus[k, j] += eps
        minus[k, j] -= eps
        numeric = (loss(params, plus.astype(np.float32)) - loss(params, minus.astype(np.float32))) / (2 * eps)
        assert row_grads[k, j] == pytest.approx(numeric, rel=2e-2, abs=1e-4)
    for i in rng.choice(params.size, 5, replace=False):
        step = np.zeros_like(params)
        step[i] = eps
        numeric = (loss(params + step, rows) - loss(params - step, rows)) / (2 * eps)
        assert grad[i] == pytest.approx(numeric, rel=2e-2, abs=1e-4)


def test_a_row_no_example_uses_gets_no_gradient_and_missing_ids_embed_as_zeros() -> None:
    model = _model()
    ids = np.array([[0, -1, -1, -1]], dtype=np.int64)
    keys, index = model.keys(ids)
    rows = np.ones((keys.size, DIM), np.float32)
    inputs = model.inputs(np.zeros((1, DENSE), np.float32), rows, index)
    np.testing.assert_array_equal(inputs[0, DENSE + DIM:], 0)
    np.testing.assert_array_equal(inputs[0, DENSE:DENSE + DIM], 1)


def test_embeddings_need_data_with_ids() -> None:
    ds = data.split(np.zeros((20, 2), np.float32), np.arange(20) % 2, test_fraction=0.2, seed=0)
    with pytest.raises(errors.ConfigError, match="no ids"):
        embedding.build(jobspec.Model(hidden_layers=(4,), embeddings=jobspec.Embeddings(dim=4)), ds)


def test_synthetic_ctr_ids_are_zipf_and_labels_follow_the_planted_model() -> None:
    x, y, ids = data.read_source("synthetic-ctr:fields=3,ids=1000,samples=20000,zipf=1.2,seed=4")
    assert x.shape == (20000, 0) and ids.shape == (20000, 3) and ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < 1000
    counts = np.bincount(ids[:, 0], minlength=1000)
    assert counts[0] > counts[10] > counts[500]  # popular ids are the small ranks
    assert 0.3 < y.mean() < 0.7
    again = data.read_source("synthetic-ctr:fields=3,ids=1000,samples=20000,zipf=1.2,seed=4")
    np.testing.assert_array_equal(again[2], ids)
    # Labels depend on the ids: the most common id of field 0 has a label rate off the mean.
    rates = [y[ids[:, 0] == i].mean() for i in range(5)]
    assert max(abs(r - y.mean()) for r in rates) > 0.05


@pytest.mark.parametrize("body, fragment", [
    ("fields=3,ids=10", "samples required"),
    ("fields=0,ids=10,samples=100", "fields must be within"),
    ("fields=2,ids=10,samples=100,zipf=x", "zipf must be a number"),
    ("fields=2,ids=10,samples=100,zipf=9", "zipf must be within"),
])
def test_bad_synthetic_ctr_parameters_are_a_config_error(body: str, fragment: str) -> None:
    with pytest.raises(errors.ConfigError, match=fragment):
        data.read_source(f"synthetic-ctr:{body}")


def test_npz_with_ids_instead_of_x(tmp_path) -> None:
    path = tmp_path / "ctr.npz"
    np.savez(path, ids=np.array([[1, -1], [2, 3], [4, 5]] * 5), y=np.arange(15) % 2)
    x, y, ids = data.read_source(f"npz:{path}")
    assert x.shape == (15, 0) and ids.shape == (15, 2)
    np.savez(path, ids=np.array([[1, -2]] * 15), y=np.arange(15) % 2)
    with pytest.raises(errors.ConfigError, match="ids must be"):
        data.read_source(f"npz:{path}")


@pytest.mark.parametrize("source, digest", [
    # Digests of (y, ids) as the generator made them before `missing` existed: unchanged.
    ("synthetic-ctr:fields=8,ids=20000,samples=60000,zipf=1.1,seed=1", "f18ec6bc0011222d"),
    ("synthetic-ctr:fields=3,ids=1000,samples=20000,zipf=1.2,seed=4", "0f0ab65be15b92b8"),
    ("synthetic-ctr:fields=3,ids=1000,samples=20000,zipf=1.2,seed=4,missing=0", "0f0ab65be15b92b8"),
])
def test_synthetic_ctr_without_missing_ids_is_unchanged(source: str, digest: str) -> None:
    _, y, ids = data.read_source(source)
    assert hashlib.sha256(y.tobytes() + ids.tobytes()).hexdigest()[:16] == digest


def test_synthetic_ctr_missing_ids_are_minus_one_and_add_nothing_to_the_planted_logit() -> None:
    body = "fields=12,ids=10000000,samples=50000,zipf=1.15,seed=3"
    full_ids, full_y, full_logits = data.synthetic_ctr(body)
    ids, y, logits = data.synthetic_ctr(body + ",missing=0.03")
    gone = ids == -1
    assert 0.027 < gone.mean() < 0.033
    np.testing.assert_array_equal(ids[~gone], full_ids[~gone])  # the ids present are the same draws
    assert ids.max() < 10_000_000
    # The planted logit is the sum of the present ids' weights: dropping an id removes its weight.
    weight_of_gone = full_logits - logits
    assert np.abs(weight_of_gone[~gone.any(axis=1)]).max() < 1e-12
    assert np.abs(weight_of_gone[gone.any(axis=1)]).min() > 0
    # Labels follow the planted logit.
    assert y[logits > 1].mean() > 0.7 > 0.3 > y[logits < -1].mean()


def test_synthetic_ctr_missing_share_is_bounded() -> None:
    with pytest.raises(errors.ConfigError, match="missing must be within 0..0.9"):
        data.read_source("synthetic-ctr:fields=2,ids=10,samples=100,missing=0.95")


def test_the_wide_part_adds_each_ids_weights_to_the_logits_with_exact_gradients() -> None:
    rng = np.random.default_rng(3)
    mlp = models.Mlp(DENSE + FIELDS * DIM, 3, hidden=(5,), activation="tanh")
    model = EmbeddingModel(mlp, dense_features=DENSE, fields=FIELDS, dim=DIM, wide=3)
    assert model.width == DIM + 3
    ids = rng.integers(-1, 6, (8, FIELDS))
    keys, index = model.keys(ids)
    x = rng.standard_normal((8, DENSE)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    params = model.init_params(1)
    rows = rng.standard_normal((keys.size, model.width)).astype(np.float32)
    # The scored model (the chief's) adds the sum of the present ids' wide values to the MLP's logits.
    scored, inputs = model.held_out(x, rows, index)
    wide_sum = np.zeros((8, 3), np.float32)
    for i, f in zip(*np.nonzero(index >= 0)):
        wide_sum[i] += rows[index[i, f], DIM:]
    np.testing.assert_allclose(scored.logits(params, inputs), mlp.logits(params, model.inputs(x, rows, index)) + wide_sum,
                               rtol=1e-5, atol=1e-6)
    _, _, row_grads = model.loss_and_grads(params, rows, (x, index, y))

    def loss(r: np.ndarray) -> float:
        m, inp = model.held_out(x, r, index)
        return m.loss(params, inp, y)

    eps = 1e-2
    for k, j in [(0, DIM), (keys.size // 2, DIM + 1), (keys.size - 1, DIM + 2), (1, 0)]:
        plus, minus = rows.copy(), rows.copy()
        plus[k, j] += eps
        minus[k, j] -= eps
        assert row_grads[k, j] == pytest.approx((loss(plus) - loss(minus)) / (2 * eps), rel=2e-2, abs=1e-4)


def test_embeddings_build_a_wide_part_of_one_weight_per_class_unless_told_not_to() -> None:
    ds = data.split(np.zeros((30, 0), np.float32), np.arange(30) % 2, test_fraction=0.2, seed=0,
                    ids=np.arange(60).reshape(30, 2))
    spec = jobspec.Model(hidden_layers=(4,), embeddings=jobspec.Embeddings(dim=3))
    assert (embedding.build(spec, ds).wide, embedding.build(spec, ds).width) == (2, 5)
    plain = embedding.build(jobspec.Model(hidden_layers=(4,), embeddings=jobspec.Embeddings(dim=3, wide=False)), ds)
    assert (plain.wide, plain.width) == (0, 3)
    m, inputs = plain.held_out(ds.x_test, np.ones((12, 3), np.float32), np.zeros((6, 2), np.int64))
    assert m is plain.mlp and inputs.shape == (6, 6)
