"""A user model for the entrypoint tests: it follows the runtime's model interface by
wrapping the built-in Mlp, and records what build_model passed to it."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from distbelief.runtime.model import models


class WrappedMlp:
    """The four interface members only (no `loss`), so evaluate() takes the
    loss_and_grad path for it."""

    def __init__(self, model_spec: Mapping[str, Any], n_features: int, n_classes: int) -> None:
        self.model_spec = model_spec
        self.n_features = n_features
        self.n_classes = n_classes
        self._inner = models.Mlp(n_features, n_classes, model_spec.get("hiddenLayers", [4]), "tanh")
        self.shapes = self._inner.shapes

    def init_params(self, seed: int) -> np.ndarray:
        return self._inner.init_params(seed)

    def loss_and_grad(self, params, batch, out=None):
        return self._inner.loss_and_grad(params, batch, out)

    def predict(self, params, x):
        return self._inner.predict(params, x)


class Incomplete:
    shapes = [("w", (3,))]

    def predict(self, params, x):
        return np.zeros(len(x), dtype=np.int64)


def build(model_spec, n_features, n_classes):
    return WrappedMlp(model_spec, n_features, n_classes)


def build_incomplete(model_spec, n_features, n_classes):
    return Incomplete()


class ReturnsNewGradient(WrappedMlp):
    """Ignores `out` and returns a gradient array of its own."""

    def loss_and_grad(self, params, batch, out=None):
        return self._inner.loss_and_grad(params, batch, None)


def build_returning_new_gradient(model_spec, n_features, n_classes):
    return ReturnsNewGradient(model_spec, n_features, n_classes)


def build_raising(model_spec, n_features, n_classes):
    raise ValueError("hidden sizes must be even")


class BadGradient(WrappedMlp):
    def loss_and_grad(self, params, batch, out=None):
        return 0.5, np.zeros(3, dtype=np.float32)


class Float64Params(WrappedMlp):
    def init_params(self, seed):
        return self._inner.init_params(seed).astype(np.float64)


class BadShapes(WrappedMlp):
    def __init__(self, *args):
        super().__init__(*args)
        self.shapes = {"w": (3, 4)}


class LabelsAsScores(WrappedMlp):
    def predict(self, params, x):
        return np.zeros((len(x), self.n_classes), dtype=np.float32)


def build_bad_gradient(model_spec, n_features, n_classes):
    return BadGradient(model_spec, n_features, n_classes)


def build_float64(model_spec, n_features, n_classes):
    return Float64Params(model_spec, n_features, n_classes)


def build_bad_shapes(model_spec, n_features, n_classes):
    return BadShapes(model_spec, n_features, n_classes)


def build_scores(model_spec, n_features, n_classes):
    return LabelsAsScores(model_spec, n_features, n_classes)


class DivergesOnceTrained(WrappedMlp):
    """Finite at its initial parameters (the check at build time), NaN once they moved."""

    def loss_and_grad(self, params, batch, out=None):
        loss, grad = self._inner.loss_and_grad(params, batch, out)
        moved = not np.array_equal(params, self._inner.init_params(0))
        return (float("nan") if moved else loss), grad


def build_diverging(model_spec, n_features, n_classes):
    return DivergesOnceTrained(model_spec, n_features, n_classes)
