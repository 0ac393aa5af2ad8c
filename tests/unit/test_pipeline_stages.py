"""The cut of a model into stages, and the stages' gradients against the whole model's."""

import numpy as np
import pytest

from distbelief.runtime import errors
from distbelief.runtime.algorithms.pipeline.ops import FETCH, PUSH, Forward
from distbelief.runtime.model import stages
from distbelief.runtime.model.models import Mlp, build_model
from distbelief.runtime.model.stages import cut, plan

from support.examples import typed_model


def chain_gradient(model, params, x, y, partitions, micro_batches=1):
    """loss and gradient computed stage by stage, as the pods of one replica do: every
    micro-batch forward through the stages, then each backward, the stages' gradients
    accumulated over the micro-batches."""
    parts = plan(model, partitions).stages
    own = [params[s.offset:s.offset + s.size] for s in parts]
    grads = [np.zeros(s.size, dtype=np.float32) for s in parts]
    micro = list(zip(np.array_split(x, micro_batches), np.array_split(y, micro_batches)))
    stashed = [forward_through(parts, own, xm) for xm, _ in micro]
    loss = 0.0
    for m, ((xm, ym), activations) in enumerate(zip(micro, stashed)):
        upstream, last = ym, m == micro_batches - 1
        for stage, p, g, acts in reversed(list(zip(parts, own, grads, activations))):
            out = np.empty_like(g)
            part, upstream = stage.backward(p, acts, upstream, out, share=len(xm) / len(x), l2=last)
            g += out
            loss += part
    return loss, np.concatenate(grads)


def forward_through(parts, own, x):
    """Each stage's activations for one micro-batch."""
    activations, inputs = [], x
    for stage, p in zip(parts, own):
        activations.append(stage.forward(p, inputs))
        inputs = activations[-1][-1]
    return activations


BUILTIN_MODELS = [
    {"type": "mlp", "hiddenLayers": [32, 16], "activation": "relu"},
    {"type": "mlp", "hiddenLayers": [24, 24, 12], "activation": "tanh", "l2": 0.01},
    {"type": "mlp", "hiddenLayers": [40, 8], "activation": "relu", "l2": 0.001},
]


@pytest.mark.parametrize("spec", BUILTIN_MODELS)
@pytest.mark.parametrize("partitions", [2, 3])
@pytest.mark.parametrize("micro_batches", [1, 4, 5])  # 5: micro-batches of 13 and 12 rows
def test_partitioned_gradient_equals_the_whole_models(spec, partitions, micro_batches):
    model = build_model(typed_model(spec), n_features=20, n_classes=5)
    rng = np.random.default_rng(3)
    params = model.init_params(7)
    params += rng.standard_normal(params.size).astype(np.float32) * 0.05  # biases off zero too
    x = rng.standard_normal((64, 20)).astype(np.float32)
    y = rng.integers(0, 5, 64)
    whole_loss, whole = model.loss_and_grad(params, (x, y))
    loss, chained = chain_gradient(model, params, x, y, partitions, micro_batches)
    assert loss == pytest.approx(whole_loss, rel=1e-6)
    assert np.linalg.norm(chained - whole) <= 1e-6 * np.linalg.norm(whole)


def test_stages_cover_the_model_in_order_without_overlap():
    model = Mlp(784, 10, [512, 512, 256])
    parts = plan(model, 3).stages
    assert [s.offset for s in parts] == [0, parts[0].size, parts[0].size + parts[1].size]
    assert sum(s.size for s in parts) == params_of(model)
    assert [s.input_width for s in parts] == [784, *[s.output_width for s in parts[:-1]]]
    assert parts[-1].output_width == 10


def params_of(model):
    return sum(int(np.prod(shape)) for _, shape in model.shapes)


def test_the_cut_minimises_the_largest_stage():
    assert cut([10, 10, 10, 10], 2) == [0, 2]
    assert cut([100, 1, 1, 1], 2) == [0, 1]
    assert cut([1, 1, 1, 100], 2) == [0, 3]
    assert cut([5, 5, 5], 3) == [0, 1, 2]
    sizes = [401_920, 262_656, 5_130]  # 784-512-512-10: the first layer outweighs the rest
    assert cut(sizes, 2) == [0, 1]


def test_a_model_cannot_have_more_stages_than_layers():
    with pytest.raises(errors.ConfigError, match="at least as many layers"):
        plan(Mlp(10, 2, [8]), 3)


@pytest.mark.parametrize("spec", [{"type": "softmax"}, {"type": "mlp", "hiddenLayers": []}])
def test_a_one_layer_model_cannot_be_partitioned(spec):
    with pytest.raises(errors.ConfigError, match="partitions"):
        plan(build_model(typed_model(spec), 10, 3), 2)


def test_a_model_that_is_not_a_builtin_mlp_is_refused():
    with pytest.raises(errors.ConfigError, match="built-in mlp"):
        plan(object(), 2)


def test_partition_count_is_bounded():
    with pytest.raises(errors.ConfigError, match="1..16"):
        plan(Mlp(10, 2, [8] * 20), stages.MAX_PARTITIONS + 1)


def test_a_forward_names_its_micro_batch_and_its_share_of_the_step():
    meta = Forward(group=1, token=2, rows=7, width=16, flags=PUSH, part=4, parts=5, step_rows=32)
    got = Forward.unpack(meta.pack())
    assert got == meta and got.last and got.share == 7 / 32


@pytest.mark.parametrize("fields,problem", [
    ({"part": 5, "parts": 5}, "micro-batch 5 of 5"),
    ({"parts": 65}, "at most 64"),
    ({"rows": 33}, "33 of 32 rows"),
    ({"flags": FETCH, "part": 1}, "FETCH goes with a step's first micro-batch"),
    ({"flags": PUSH, "part": 0}, "PUSH with its last"),
])
def test_a_forward_out_of_its_step_is_refused(fields, problem):
    meta = Forward(**{"group": 1, "token": 2, "rows": 8, "width": 16, "flags": 0, "part": 0, "parts": 5,
                      "step_rows": 32, **fields})
    with pytest.raises(errors.ProtocolError, match=problem):
        Forward.unpack(meta.pack())
