"""A user model for DistBelief, ready to copy: softmax regression with L2, in plain numpy.

The job names it as `entrypoint: "linear_model:build"`; every shard and replica imports
this module (it must be on PYTHONPATH) and calls build(model_spec, n_features,
n_classes). The returned object follows the runtime's model interface:

    shapes                                  [(name, shape), ...]: the named arrays
    init_params(seed) -> params             ONE flat float32 vector: the arrays of shapes,
                                            flattened and concatenated in that order
    loss_and_grad(params, (x, y), out)      -> (loss, gradient); write the gradient into
                                            `out` (a flat float32 vector like params)
    predict(params, x) -> labels            integer class labels, one per row of x
    loss(params, x, y) -> float             optional: held-out loss without a gradient
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np


class SoftmaxRegression:
    def __init__(self, n_features: int, n_classes: int, l2: float) -> None:
        self.shapes = [("weight", (n_features, n_classes)), ("bias", (n_classes,))]
        self.n_features, self.n_classes, self.l2 = n_features, n_classes, np.float32(l2)

    def _split(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Views (no copies) of the named arrays inside a flat vector."""
        size = self.n_features * self.n_classes
        return flat[:size].reshape(self.n_features, self.n_classes), flat[size:]

    def init_params(self, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        params = np.zeros(self.n_features * self.n_classes + self.n_classes, dtype=np.float32)
        weight, _ = self._split(params)
        weight[...] = rng.normal(0.0, 0.01, weight.shape)
        return params

    def _probabilities(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        weight, bias = self._split(params)
        logits = x @ weight + bias
        logits -= logits.max(axis=1, keepdims=True)
        exp = np.exp(logits)
        return exp / exp.sum(axis=1, keepdims=True)

    def loss_and_grad(self, params: np.ndarray, batch: tuple[np.ndarray, np.ndarray],
                      out: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        x, y = batch
        out = np.empty_like(params) if out is None else out
        weight, _ = self._split(params)
        probabilities = self._probabilities(params, x)
        rows = np.arange(len(y))
        loss = -float(np.mean(np.log(probabilities[rows, y] + 1e-12))) + 0.5 * float(self.l2) * float(np.sum(weight ** 2))
        probabilities[rows, y] -= 1.0
        probabilities /= len(y)
        grad_weight, grad_bias = self._split(out)
        np.matmul(x.T, probabilities, out=grad_weight)
        grad_weight += self.l2 * weight
        np.sum(probabilities, axis=0, out=grad_bias)
        return loss, out

    def predict(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        return np.argmax(self._probabilities(params, x), axis=1)

    def loss(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        probabilities = self._probabilities(params, x)
        return -float(np.mean(np.log(probabilities[np.arange(len(y)), y] + 1e-12)))


def build(model_spec: Mapping[str, Any], n_features: int, n_classes: int) -> SoftmaxRegression:
    """The entrypoint: model_spec is the job's spec.model (extra keys are yours to use)."""
    return SoftmaxRegression(n_features, n_classes, l2=float(model_spec.get("l2", 0.0)))
