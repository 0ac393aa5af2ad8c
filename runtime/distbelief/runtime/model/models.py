"""Models the replicas train: the interface, the built-ins, and user models by entrypoint.

A model sees its parameters only as one flat float32 vector (the concatenation of its
named arrays in `shapes` order), which is what the shards store. The interface:

    shapes                          [(name, shape), ...]
    init_params(seed) -> flat       the initial parameters, deterministic in the seed
    loss_and_grad(params, batch, out=None) -> (loss, grad)   batch = (x, y)
    predict(params, x) -> labels

A user model is a function "package.module:build" taking (model_spec, n_features,
n_classes) and returning an object with those members.
"""

from __future__ import annotations

import importlib
import os
import zipfile
from typing import Any, Iterable, Mapping, Protocol, Sequence

import numpy as np

from distbelief.runtime import errors, jobbase, jobspec

Batch = tuple[np.ndarray, np.ndarray]
EVAL_CHUNK = 4096
INIT_CHUNK = 1 << 22  # initial weights are drawn this many at a time


class Model(Protocol):
    @property
    def shapes(self) -> Sequence[tuple[str, tuple[int, ...]]]: ...

    def init_params(self, seed: int) -> np.ndarray: ...

    def loss_and_grad(self, params: np.ndarray, batch: Batch,
                      out: np.ndarray | None = None) -> tuple[float, np.ndarray]: ...

    def predict(self, params: np.ndarray, x: np.ndarray) -> np.ndarray: ...


def num_params(model: Model) -> int:
    return sum(int(np.prod(shape)) for _, shape in model.shapes)


def initial_slice(model: Model, seed: int, start: int, stop: int) -> np.ndarray:
    """Values [start, stop) of the model's initial parameters (a shard's slice)."""
    init_slice = getattr(model, "init_slice", None)
    if init_slice is not None:
        return init_slice(seed, start, stop)
    return np.array(model.init_params(seed)[start:stop])  # user models: made whole, then cut


def save_params(path: str, tensors: Iterable[tuple[str, np.ndarray]]) -> None:
    """Write named tensors to an .npz file (np.load reads it), one at a time as they come,
    then move it into place: a reader never sees half a file."""
    with zipfile.ZipFile(path + ".tmp", "w", allowZip64=True) as archive:
        for name, array in tensors:
            with archive.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(array))
    os.replace(path + ".tmp", path)


def split_params(model: Model, flat: np.ndarray) -> dict[str, np.ndarray]:
    """Named views (no copies) of a flat parameter vector."""
    views, offset = {}, 0
    for name, shape in model.shapes:
        size = int(np.prod(shape))
        views[name] = flat[offset:offset + size].reshape(shape)
        offset += size
    return views


class Mlp:
    """A fully connected network ending in softmax cross-entropy; no hidden layer = softmax
    regression. L2 regularisation applies to the weights, not the biases."""

    def __init__(self, n_features: int, n_classes: int, hidden: Sequence[int] = (),
                 activation: str = "relu", l2: float = 0.0) -> None:
        if activation not in ("relu", "tanh"):
            raise errors.ConfigError(f"unknown activation {activation!r}")
        widths = [n_features, *hidden, n_classes]
        self.activation = activation
        self.l2 = np.float32(l2)
        self.shapes = []
        for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
            self.shapes += [(f"layer{i}.weight", (fan_in, fan_out)), (f"layer{i}.bias", (fan_out,))]

    def _layers(self, flat: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        views = list(split_params(self, flat).values())
        return list(zip(views[0::2], views[1::2]))

    def init_params(self, seed: int) -> np.ndarray:
        return self.init_slice(seed, 0, num_params(self))

    def init_slice(self, seed: int, start: int, stop: int) -> np.ndarray:
        """Values [start, stop) of init_params(seed), made without holding the rest: a shard
        of a model larger than its memory initialises only its own slice. Weights are He
        (relu) or Glorot-style (tanh) normals drawn from one stream in layer order, biases 0."""
        out = np.zeros(stop - start, dtype=np.float32)
        if self.depth == 1:
            return out  # softmax regression: zero is the natural start of a convex problem
        rng = np.random.default_rng(seed)
        gain = 2.0 if self.activation == "relu" else 1.0
        offset = 0
        for (_, (fan_in, fan_out)), (_, bias) in zip(self.shapes[0::2], self.shapes[1::2]):
            if offset >= stop:
                break  # the stream's later draws are other layers'
            scale = np.float32(np.sqrt(gain / fan_in))
            for first in range(offset, offset + fan_in * fan_out, INIT_CHUNK):
                last = min(first + INIT_CHUNK, offset + fan_in * fan_out)
                values = rng.standard_normal(last - first, dtype=np.float32)  # drawn even if unused: same stream
                low, high = max(first, start), min(last, stop)
                if low < high:
                    out[low - start:high - start] = values[low - first:high - first] * scale
            offset += fan_in * fan_out + bias[0]
        return out

    @property
    def depth(self) -> int:
        return len(self.shapes) // 2

    def forward_layers(self, layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray,
                       first: int = 0) -> list[np.ndarray]:
        """The input and every layer's output for layers first, first+1, ... of the network
        (their (weight, bias) pairs); each output but the network's last is activated."""
        activations = [x]
        for j, (weight, bias) in enumerate(layers):
            h = activations[-1] @ weight
            h += bias
            if first + j < self.depth - 1:
                self._activate(h)
            activations.append(h)
        return activations

    def _activate(self, h: np.ndarray) -> None:
        if self.activation == "relu":
            np.maximum(h, 0, out=h)
        else:
            np.tanh(h, out=h)

    def activation_grad(self, delta: np.ndarray, h: np.ndarray) -> None:
        """delta (the gradient w.r.t. an activated output h) becomes the gradient w.r.t. the
        layer's output before its activation."""
        if self.activation == "relu":
            delta *= h > 0
        else:
            delta *= 1 - h * h

    def backward_layers(self, layers: list[tuple[np.ndarray, np.ndarray]], grads: list[tuple[np.ndarray, np.ndarray]],
                        activations: list[np.ndarray], delta: np.ndarray, *, input_grad: bool) -> np.ndarray | None:
        """Given delta = d(loss)/d(the last layer's pre-activation output), write each layer's
        gradient into grads; returns d(loss)/d(the first layer's input) with input_grad."""
        for i in range(len(layers) - 1, -1, -1):
            weight, _ = layers[i]
            grad_w, grad_b = grads[i]
            np.matmul(activations[i].T, delta, out=grad_w)
            np.sum(delta, axis=0, out=grad_b)
            if i > 0 or input_grad:
                delta = delta @ weight.T
            if i > 0:
                self.activation_grad(delta, activations[i])
        return delta if input_grad else None

    def add_l2(self, layers: list[tuple[np.ndarray, np.ndarray]], grads: list[tuple[np.ndarray, np.ndarray]]) -> float:
        """Add the L2 term's gradient to grads; returns the term's value (0 without l2)."""
        if not self.l2:
            return 0.0
        for (weight, _), (grad_w, _) in zip(layers, grads):
            grad_w += self.l2 * weight
        return self.l2_penalty(layers)

    def _logits(self, layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
        return self.forward_layers(layers, x)[-1]

    def loss_and_grad(self, params: np.ndarray, batch: Batch,
                      out: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        loss, grad, _ = self.backward(params, batch, out)
        return loss, grad

    def backward(self, params: np.ndarray, batch: Batch, out: np.ndarray | None = None, *,
                 input_grad: bool = False) -> tuple[float, np.ndarray, np.ndarray | None]:
        """loss, its gradient w.r.t. params, and (with input_grad) w.r.t. the inputs x."""
        loss, grad, delta, _ = self.backward_offset(params, batch, None, out, input_grad=input_grad)
        return loss, grad, delta

    def backward_offset(self, params: np.ndarray, batch: Batch, offset: np.ndarray | None,
                        out: np.ndarray | None = None, *,
                        input_grad: bool = False) -> tuple[float, np.ndarray, np.ndarray | None, np.ndarray]:
        """backward() of the network whose logits get `offset` [n, classes] added (a wide
        part's, embedding.py); also returns d(loss)/d(logits), which is d(loss)/d(offset)."""
        x, y = batch
        layers = self._layers(params)
        grad = np.empty_like(params) if out is None else out
        grads = self._layers(grad)
        activations = self.forward_layers(layers, x)
        logit_grad = activations.pop()
        if offset is not None:
            logit_grad += offset
        loss = softmax_cross_entropy_inplace(logit_grad, y)  # now d(loss)/d(logits)
        delta = self.backward_layers(layers, grads, activations, logit_grad, input_grad=input_grad)
        loss += self.add_l2(layers, grads)
        return loss, grad, delta, logit_grad

    def predict(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        return np.argmax(self._logits(self._layers(params), x), axis=1)

    def logits(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        return self._logits(self._layers(params), x)

    def loss(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        logits = self._logits(self._layers(params), x)
        loss = softmax_cross_entropy_inplace(logits, y)
        return loss + self.l2_penalty(self._layers(params)) if self.l2 else loss

    def l2_penalty(self, layers: list[tuple[np.ndarray, np.ndarray]]) -> float:
        """l2/2 times the sum of the squared weights (biases are not regularised)."""
        return 0.5 * float(self.l2) * sum(float(np.vdot(weight, weight)) for weight, _ in layers)


def softmax_cross_entropy_inplace(logits: np.ndarray, y: np.ndarray) -> float:
    """Mean cross-entropy of integer labels; overwrites logits with its gradient."""
    n = logits.shape[0]
    logits -= logits.max(axis=1, keepdims=True)
    np.exp(logits, out=logits)
    total = logits.sum(axis=1, keepdims=True)
    rows = np.arange(n)
    picked = logits[rows, y] / total[:, 0]
    loss = -float(np.mean(np.log(np.maximum(picked, 1e-30), dtype=np.float64)))
    logits /= total
    logits[rows, y] -= 1.0
    logits *= np.float32(1.0 / n)
    return loss


def evaluate(model: Model, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Held-out (loss, accuracy), in chunks so memory stays bounded for large sets.

    Uses the model's own `loss(params, x, y)` when it has one (no gradient needed)."""
    correct, loss_sum = 0, 0.0
    loss_of = getattr(model, "loss", None)
    scratch = None if loss_of else np.empty_like(params)
    for start in range(0, len(x), EVAL_CHUNK):
        xb, yb = x[start:start + EVAL_CHUNK], y[start:start + EVAL_CHUNK]
        correct += int(np.sum(model.predict(params, xb) == yb))
        loss = loss_of(params, xb, yb) if loss_of else model.loss_and_grad(params, (xb, yb), scratch)[0]
        loss_sum += loss * len(xb)
    return loss_sum / len(x), correct / len(x)


def held_out_auc(model: Model, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> float | None:
    """The area under the ROC curve of a two-class model on (x, y); None for a model without
    logits, or a set holding one class only."""
    logits_of = getattr(model, "logits", None)
    if logits_of is None:
        return None
    margins = [np.diff(logits_of(params, x[s:s + EVAL_CHUNK]), axis=1)[:, 0] for s in range(0, len(x), EVAL_CHUNK)]
    return auc(np.concatenate(margins), y)


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Rank-based (Mann-Whitney) AUC of scores for labels 0/1, tied scores sharing their mean rank."""
    positives = int(np.sum(labels == 1))
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return None
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_scores)) + 1]
    ends = np.r_[starts[1:], scores.size]
    ranks = np.empty(scores.size, dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)  # 1-based mean rank of each tie
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def build_model(spec: jobspec.Model, n_features: int, n_classes: int) -> Model:
    """The model a job's spec.model describes (its embeddings aside: embedding.build)."""
    if spec.entrypoint:
        return _load_entrypoint(spec.entrypoint, jobbase.as_spec(spec), n_features, n_classes)
    if spec.builtin not in ("mlp", "softmax"):
        raise errors.ConfigError(f"spec.model.type: unknown model type {spec.builtin!r}")
    hidden = list(spec.hidden_layers) if spec.builtin == "mlp" else []
    return Mlp(n_features, n_classes, hidden, spec.activation, spec.l2)


def _load_entrypoint(entrypoint: str, written: Mapping[str, Any], n_features: int, n_classes: int) -> Model:
    """User code's model: the entrypoint called with spec.model as a mapping (every default applied)."""
    module_name, _, function_name = entrypoint.partition(":")
    try:
        build = getattr(importlib.import_module(module_name), function_name)
    except Exception as exc:  # user code: an import may fail in any way, and must not crash the role unexplained
        raise errors.ConfigError(f"spec.model.entrypoint: cannot load {entrypoint!r}: {exc}") from exc
    model = _call(entrypoint, "", build, dict(written), n_features, n_classes)
    missing = [m for m in ("shapes", "init_params", "loss_and_grad", "predict") if not hasattr(model, m)]
    if missing:
        raise errors.ConfigError(
            f"spec.model.entrypoint: {entrypoint!r} returned a model without {', '.join(missing)}"
        )
    return check_interface(model, entrypoint, n_features, n_classes)


def _call(entrypoint: str, member: str, function: Any, *args: Any) -> Any:
    """function(*args); whatever user code raises becomes one line naming the function."""
    try:
        return function(*args)
    except Exception as exc:  # user code may raise anything: the role must say where, not crash
        where = f"{entrypoint!r}" + (f" model's {member}" if member else "")
        raise errors.ConfigError(f"spec.model.entrypoint: {where} raised {type(exc).__name__}: {exc}") from exc


def check_interface(model: Model, entrypoint: str, n_features: int, n_classes: int) -> Model:
    """Call a user model once on a tiny batch and check what each member returns. Returns
    the model as the roles use it: one whose gradient is in `out` even when its
    loss_and_grad returns a new array instead of writing there."""
    def bad(member: str, wanted: str, got: object) -> errors.ConfigError:
        return errors.ConfigError(f"spec.model.entrypoint: {entrypoint!r} model's {member} must {wanted}; got {got}")

    shapes = list(model.shapes) if isinstance(model.shapes, (list, tuple)) else None
    if not shapes or not all(_is_shape_entry(entry) for entry in shapes):
        raise bad("shapes", "be a list of (name, shape) pairs with positive sizes", _brief(model.shapes))
    size = num_params(model)
    params = _call(entrypoint, "init_params", model.init_params, 0)
    if not isinstance(params, np.ndarray) or params.dtype != np.float32 or params.shape != (size,):
        raise bad("init_params(seed)", f"return one flat float32 vector of {size} values (the sizes in shapes)",
                  _brief(params))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, n_features), dtype=np.float32)
    y = np.array([0, n_classes - 1], dtype=np.int64)
    out = np.zeros_like(params)
    returned = _call(entrypoint, "loss_and_grad", model.loss_and_grad, params, (x, y), out)
    if not isinstance(returned, tuple) or len(returned) != 2:
        raise bad("loss_and_grad(params, (x, y), out)", "return (loss, gradient)", _brief(returned))
    loss, grad = returned
    if np.ndim(loss) != 0 or not np.isfinite(float(loss)):
        raise bad("loss_and_grad(params, (x, y), out)", "return a finite number as the loss", _brief(loss))
    if not isinstance(grad, np.ndarray) or grad.shape != params.shape:
        raise bad("loss_and_grad(params, (x, y), out)", f"return a gradient of shape {params.shape}", _brief(grad))
    labels = _call(entrypoint, "predict", model.predict, params, x)
    if not isinstance(labels, np.ndarray) or labels.shape != (2,) or not np.issubdtype(labels.dtype, np.integer):
        raise bad("predict(params, x)", "return one integer label per row of x", _brief(labels))
    return model if grad is out else GradientIntoOut(model)


def _is_shape_entry(entry: object) -> bool:
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[0], str):
        return False
    shape = entry[1]
    return isinstance(shape, (list, tuple)) and all(isinstance(d, (int, np.integer)) and d > 0 for d in shape)


def _brief(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return f"{type(value).__name__} {str(value)[:60]}"


class GradientIntoOut:
    """A user model whose loss_and_grad returns a new gradient array: the roles read the
    gradient from `out`, so it is copied there."""

    def __init__(self, model: Model) -> None:
        self._model = model
        self.shapes = model.shapes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def loss_and_grad(self, params: np.ndarray, batch: Batch,
                      out: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        loss, grad = self._model.loss_and_grad(params, batch, out)
        if out is None or grad is out:
            return loss, grad
        np.copyto(out, grad)
        return loss, out
