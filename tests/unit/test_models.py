"""Unit tests of distbelief.runtime.model.models: gradients by finite differences, the flat
parameter vector, evaluation, and building models from a spec (built-in or user code)."""

from __future__ import annotations


import numpy as np
import pytest

from distbelief.runtime import errors, jobbase, jobspec
from distbelief.runtime.model import models
from distbelief.runtime.model.models import Mlp

from support.examples import typed_model
from support.paths import TESTS


N_FEATURES, N_CLASSES, N_EXAMPLES = 7, 5, 16


# --- an independent float64 reference of the network -----------------------------------

def reference_logits(model: Mlp, params: np.ndarray, x: np.ndarray) -> np.ndarray:
    views = list(models.split_params(model, np.asarray(params, dtype=np.float64)).values())
    layers = list(zip(views[0::2], views[1::2]))
    h = np.asarray(x, dtype=np.float64)
    for weight, bias in layers[:-1]:
        h = h @ weight + bias
        h = np.maximum(h, 0.0) if model.activation == "relu" else np.tanh(h)
    weight, bias = layers[-1]
    return h @ weight + bias


def reference_loss(model: Mlp, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """Mean softmax cross-entropy plus 0.5 * l2 * |weights|^2, all in float64."""
    logits = reference_logits(model, params, x)
    logits = logits - logits.max(axis=1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    loss = -float(np.mean(log_p[np.arange(len(y)), y]))
    views = list(models.split_params(model, np.asarray(params, dtype=np.float64)).values())
    l2 = float(model.l2)
    return loss + sum(0.5 * l2 * float(np.sum(w * w)) for w in views[0::2])


def sample_coordinates(model: Mlp, total: int = 50, seed: int = 0) -> np.ndarray:
    """~total flat indices, spread over every named array so each layer and bias is hit."""
    rng = np.random.default_rng(seed)
    per_array = -(-total // len(model.shapes))
    picked, offset = [], 0
    for _, shape in model.shapes:
        size = int(np.prod(shape))
        picked.extend(offset + rng.choice(size, size=min(per_array, size), replace=False))
        offset += size
    return np.array(sorted(picked))


def gradient_error(model: Mlp, params: np.ndarray, batch, grad: np.ndarray,
                   eps: float = 1e-6) -> float:
    """Largest relative difference between grad and central differences of the float64
    reference loss, over a sample of coordinates. Relative to max(|numeric|, |analytic|)
    floored at 1e-3 of the largest numeric entry, so near-zero entries do not blow up."""
    x, y = batch
    base = np.asarray(params, dtype=np.float64)
    coords = sample_coordinates(model)
    numeric = np.empty(len(coords))
    for k, i in enumerate(coords):
        plus, minus = base.copy(), base.copy()
        plus[i] += eps
        minus[i] -= eps
        numeric[k] = (reference_loss(model, plus, x, y) - reference_loss(model, minus, x, y)) / (2 * eps)
    analytic = np.asarray(grad, dtype=np.float64)[coords]
    assert np.max(np.abs(numeric)) > 1e-4, "degenerate check: the sampled gradient is ~0"
    floor = 1e-3 * np.max(np.abs(numeric))
    scale = np.maximum(np.maximum(np.abs(numeric), np.abs(analytic)), floor)
    return float(np.max(np.abs(numeric - analytic) / scale))


def make_batch(seed: int = 1, n: int = N_EXAMPLES):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, N_FEATURES)).astype(np.float32)
    y = rng.integers(0, N_CLASSES, size=n)
    return x, y


def random_params(model: Mlp, seed: int = 2) -> np.ndarray:
    """Random weights and non-zero biases (the built-in init leaves biases at 0 and a
    softmax at all zeros, where the l2 gradient would vanish)."""
    rng = np.random.default_rng(seed)
    return (0.5 * rng.standard_normal(models.num_params(model))).astype(np.float32)


CASES = {
    "mlp-relu": dict(hidden=(8,), activation="relu", l2=0.0),
    "mlp-tanh": dict(hidden=(8,), activation="tanh", l2=0.0),
    "mlp-two-hidden": dict(hidden=(8, 6), activation="relu", l2=0.0),
    "mlp-tanh-two-hidden-l2": dict(hidden=(6, 5), activation="tanh", l2=0.1),
    "softmax-l2": dict(hidden=(), activation="relu", l2=0.05),
}


def make_model(case: str) -> Mlp:
    return Mlp(N_FEATURES, N_CLASSES, **CASES[case])


# --- gradients ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_gradient_matches_finite_differences(case):
    model = make_model(case)
    params, batch = random_params(model), make_batch()
    loss, grad = model.loss_and_grad(params, batch)
    assert grad.dtype == np.float32 and grad.shape == params.shape
    assert loss == pytest.approx(reference_loss(model, params, *batch), rel=1e-5)
    assert gradient_error(model, params, batch, grad) < 1e-2


@pytest.mark.parametrize("case", CASES)
def test_gradient_check_rejects_a_wrong_gradient(case):
    """The check above can fail: a gradient off by 10% does not pass it."""
    model = make_model(case)
    params, batch = random_params(model), make_batch()
    _, grad = model.loss_and_grad(params, batch)
    assert gradient_error(model, params, batch, grad * np.float32(1.1)) > 1e-2


def test_gradient_check_rejects_a_wrong_layer():
    """Breaking one array of the gradient (the first layer's bias) is caught too."""
    model = make_model("mlp-two-hidden")
    params, batch = random_params(model), make_batch()
    _, grad = model.loss_and_grad(params, batch)
    models.split_params(model, grad)["layer0.bias"][...] *= -1
    assert gradient_error(model, params, batch, grad) > 1e-2


def test_l2_adds_its_term_to_loss_and_gradient():
    plain = Mlp(N_FEATURES, N_CLASSES, (), l2=0.0)
    regular = Mlp(N_FEATURES, N_CLASSES, (), l2=0.25)
    params, batch = random_params(plain), make_batch()
    loss0, grad0 = plain.loss_and_grad(params, batch)
    loss1, grad1 = regular.loss_and_grad(params, batch)
    weight = models.split_params(plain, params)["layer0.weight"].astype(np.float64)
    assert loss1 - loss0 == pytest.approx(0.5 * 0.25 * np.sum(weight * weight), rel=1e-5)
    g0, g1 = models.split_params(plain, grad0), models.split_params(plain, grad1)
    np.testing.assert_allclose(g1["layer0.weight"] - g0["layer0.weight"], 0.25 * weight, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(g1["layer0.bias"], g0["layer0.bias"])  # biases are not regularised


def test_loss_at_zero_is_log_of_class_count():
    model = Mlp(N_FEATURES, N_CLASSES)
    loss, grad = model.loss_and_grad(model.init_params(0), make_batch())
    assert loss == pytest.approx(np.log(N_CLASSES), rel=1e-6)
    assert np.all(np.isfinite(grad))


def test_loss_stays_finite_for_huge_logits():
    model = Mlp(N_FEATURES, N_CLASSES)
    params = np.full(models.num_params(model), 1e3, dtype=np.float32)
    x, y = make_batch()
    loss, grad = model.loss_and_grad(params, (x * 100, y))
    assert np.isfinite(loss) and np.all(np.isfinite(grad))


def test_out_buffer_is_written_and_returned():
    model = make_model("mlp-two-hidden")
    params, batch = random_params(model), make_batch()
    expected_loss, expected = model.loss_and_grad(params, batch)
    out = np.full_like(params, np.nan)
    loss, grad = model.loss_and_grad(params, batch, out=out)
    assert grad is out
    assert loss == expected_loss
    np.testing.assert_array_equal(out, expected)


def test_loss_and_grad_leaves_params_and_batch_alone():
    model = make_model("mlp-tanh-two-hidden-l2")
    params, (x, y) = random_params(model), make_batch()
    saved = params.copy(), x.copy(), y.copy()
    model.loss_and_grad(params, (x, y))
    for before, after in zip(saved, (params, x, y)):
        np.testing.assert_array_equal(before, after)


def test_predict_is_argmax_of_logits():
    model = make_model("mlp-tanh")
    params, (x, _) = random_params(model), make_batch(n=40)
    predicted = model.predict(params, x)
    np.testing.assert_array_equal(predicted, np.argmax(reference_logits(model, params, x), axis=1))
    assert len(set(predicted.tolist())) > 1


# --- parameters --------------------------------------------------------------------------

def test_shapes_name_every_layer_in_order():
    model = Mlp(64, 10, (32, 16))
    assert list(model.shapes) == [
        ("layer0.weight", (64, 32)), ("layer0.bias", (32,)),
        ("layer1.weight", (32, 16)), ("layer1.bias", (16,)),
        ("layer2.weight", (16, 10)), ("layer2.bias", (10,)),
    ]
    assert models.num_params(model) == 64 * 32 + 32 + 32 * 16 + 16 + 16 * 10 + 10


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_init_is_deterministic_in_the_seed(activation):
    model = Mlp(64, 10, (256,), activation)
    first = model.init_params(7)
    assert first.dtype == np.float32 and first.shape == (models.num_params(model),)
    np.testing.assert_array_equal(first, model.init_params(7))
    assert not np.array_equal(first, model.init_params(8))
    views = models.split_params(model, first)
    assert not np.any(views["layer0.bias"]) and not np.any(views["layer1.bias"])
    gain = 2.0 if activation == "relu" else 1.0
    assert np.std(views["layer0.weight"]) == pytest.approx(np.sqrt(gain / 64), rel=0.1)
    assert np.std(views["layer1.weight"]) == pytest.approx(np.sqrt(gain / 256), rel=0.1)


def test_softmax_starts_at_zero():
    model = Mlp(64, 10)
    params = model.init_params(3)
    assert params.dtype == np.float32 and params.size == 64 * 10 + 10
    assert not np.any(params)


def test_split_params_gives_views_that_cover_the_flat_vector():
    model = Mlp(5, 3, (4, 2))
    flat = np.arange(models.num_params(model), dtype=np.float32)
    views = models.split_params(model, flat)
    assert list(views) == [name for name, _ in model.shapes]
    for (_name, shape), view in zip(model.shapes, views.values()):
        assert view.shape == shape
        assert np.shares_memory(view, flat)
    np.testing.assert_array_equal(np.concatenate([v.ravel() for v in views.values()]), flat)
    views["layer1.bias"][...] = -1  # writes go through to the flat vector
    stop = models.num_params(model) - 3 * 2 - 3
    np.testing.assert_array_equal(flat[stop - 2:stop], [-1, -1])
    assert np.count_nonzero(flat == -1) == 2


def test_unknown_activation_is_a_config_error():
    with pytest.raises(errors.ConfigError, match="sigmoid"):
        Mlp(3, 2, (4,), "sigmoid")


# --- evaluation --------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [7, models.EVAL_CHUNK])
def test_evaluate_matches_a_direct_computation(monkeypatch, chunk):
    monkeypatch.setattr(models, "EVAL_CHUNK", chunk)
    model = make_model("mlp-tanh-two-hidden-l2")
    params, (x, y) = random_params(model), make_batch(seed=5, n=50)
    loss, accuracy = models.evaluate(model, params, x, y)
    assert loss == pytest.approx(reference_loss(model, params, x, y), rel=1e-5)
    expected = np.mean(np.argmax(reference_logits(model, params, x), axis=1) == y)
    assert accuracy == pytest.approx(expected)
    assert 0 < accuracy < 1  # the figure means something for this data


def test_evaluate_uses_loss_and_grad_when_a_model_has_no_loss(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setattr(models, "EVAL_CHUNK", 9)
    user = models.build_model(typed_model({"entrypoint": "user_model:build", "hiddenLayers": [6]}), N_FEATURES,
                              N_CLASSES)
    assert not hasattr(user, "loss")
    builtin = Mlp(N_FEATURES, N_CLASSES, (6,), "tanh")
    params, (x, y) = random_params(builtin), make_batch(seed=6, n=40)
    assert models.evaluate(user, params, x, y) == pytest.approx(models.evaluate(builtin, params, x, y), rel=1e-5)
    assert models.evaluate(user, params, x, y)[0] == pytest.approx(reference_loss(builtin, params, x, y), rel=1e-5)


# --- build_model -------------------------------------------------------------------------

def test_build_mlp_from_spec():
    model = models.build_model(jobspec.Model(type="mlp", hidden_layers=(16, 8), activation="tanh", l2=0.01), 64, 10)
    assert isinstance(model, Mlp)
    assert [shape for _, shape in model.shapes] == [(64, 16), (16,), (16, 8), (8,), (8, 10), (10,)]
    assert model.activation == "tanh"
    assert float(model.l2) == pytest.approx(0.01)


def test_build_defaults_to_the_crds_mlp():
    model = models.build_model(jobspec.Model(), 64, 10)
    assert [shape for _, shape in model.shapes] == [(64, 64), (64,), (64, 10), (10,)]
    assert model.activation == "relu" and float(model.l2) == 0.0


def test_build_softmax_ignores_hidden_layers():
    model = models.build_model(jobspec.Model(type="softmax", hidden_layers=(32,), l2=0.5), 64, 10)
    assert [shape for _, shape in model.shapes] == [(64, 10), (10,)]
    assert float(model.l2) == pytest.approx(0.5)


def test_build_unknown_type_is_a_config_error():
    with pytest.raises(errors.ConfigError, match=r"spec\.model\.type.*'cnn'"):
        models.build_model(jobspec.Model(type="cnn"), 64, 10)


def test_entrypoint_loads_a_user_model(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    typed = typed_model({"entrypoint": "user_model:build", "hiddenLayers": [5]})
    model = models.build_model(typed, N_FEATURES, N_CLASSES)
    assert type(model).__name__ == "WrappedMlp"
    assert model.model_spec == jobbase.as_spec(typed)   # spec.model as a mapping, every default applied
    assert model.model_spec["hiddenLayers"] == [5] and model.model_spec["activation"] == "relu"
    assert "type" not in model.model_spec               # unset: user code is no built-in type
    assert (model.n_features, model.n_classes) == (N_FEATURES, N_CLASSES)
    assert [shape for _, shape in model.shapes] == [(N_FEATURES, 5), (5,), (5, N_CLASSES), (N_CLASSES,)]
    params = model.init_params(0)
    loss, grad = model.loss_and_grad(params, make_batch())
    assert np.isfinite(loss) and grad.shape == params.shape


@pytest.mark.parametrize("entrypoint, fragment", [
    ("no_such_module_for_distbelief_tests:build", "no_such_module_for_distbelief_tests"),
    ("user_model:no_such_function", "no_such_function"),
    ("user_model", "user_model"),  # no function named at all
])
def test_entrypoint_that_cannot_be_loaded_is_a_config_error(monkeypatch, entrypoint, fragment):
    monkeypatch.syspath_prepend(str(TESTS))
    with pytest.raises(errors.ConfigError) as info:
        models.build_model(typed_model({"entrypoint": entrypoint}), N_FEATURES, N_CLASSES)
    message = str(info.value)
    assert message.startswith("spec.model.entrypoint: cannot load")
    assert repr(entrypoint) in message and fragment in message


def test_entrypoint_returning_an_incomplete_model_is_a_config_error(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    with pytest.raises(errors.ConfigError) as info:
        models.build_model(typed_model({"entrypoint": "user_model:build_incomplete"}), N_FEATURES, N_CLASSES)
    message = str(info.value)
    assert "spec.model.entrypoint" in message and "'user_model:build_incomplete'" in message
    assert "init_params" in message and "loss_and_grad" in message
    assert "shapes" not in message and "predict" not in message  # it has those two


@pytest.mark.parametrize("function, fragment", [
    ("build_raising", "'user_model:build_raising' raised ValueError: hidden sizes must be even"),
    ("build_bad_gradient", "model's loss_and_grad(params, (x, y), out) must return a gradient of shape"),
    ("build_float64", "model's init_params(seed) must return one flat float32 vector"),
    ("build_bad_shapes", "model's shapes must be a list of (name, shape) pairs"),
    ("build_scores", "model's predict(params, x) must return one integer label per row of x"),
])
def test_an_entrypoint_that_breaks_the_interface_is_one_line_naming_the_function(monkeypatch, function, fragment):
    monkeypatch.syspath_prepend(str(TESTS))
    with pytest.raises(errors.ConfigError) as info:
        models.build_model(typed_model({"entrypoint": f"user_model:{function}"}), N_FEATURES, N_CLASSES)
    message = str(info.value)
    assert message.startswith("spec.model.entrypoint: ") and fragment in message and "\n" not in message
    assert "cannot read job config" not in message


def test_a_gradient_returned_instead_of_written_into_out_reaches_out(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    written = {"entrypoint": "user_model:build_returning_new_gradient", "hiddenLayers": [4]}
    model = models.build_model(typed_model(written), N_FEATURES, N_CLASSES)
    builtin = Mlp(N_FEATURES, N_CLASSES, (4,), "tanh")
    params, batch = random_params(builtin), make_batch()
    out = np.zeros_like(params)
    loss, grad = model.loss_and_grad(params, batch, out=out)
    expected_loss, expected = builtin.loss_and_grad(params, batch)
    assert grad is out and loss == pytest.approx(expected_loss)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert np.abs(out).sum() > 0


@pytest.mark.parametrize("hidden,activation", [([300, 200], "relu"), ([50], "tanh"), ([], "relu")])
def test_a_slice_of_the_initial_parameters_is_made_without_the_rest(hidden, activation, monkeypatch):
    model = Mlp(784, 10, hidden, activation)
    whole = model.init_params(3)
    monkeypatch.setattr(models, "INIT_CHUNK", 1000)  # slices straddle the chunks the stream is drawn in
    for start, stop in ((0, 10), (999, 1001), (5000, whole.size), (whole.size - 7, whole.size)):
        np.testing.assert_array_equal(models.initial_slice(model, 3, start, stop), whole[start:stop])
