"""Unit tests of distbelief.runtime.params.optim: SGD and Adagrad against a naive reference
and, bit for bit, against numpy's float32 ufuncs, their state, the promise of no model-sized
temporaries, and their compiled loops (kernels.py)."""

from __future__ import annotations

import os
import tracemalloc

import numba
import numpy as np
import numpy.testing  # (here, at collection: numpy 1.26 runs lscpu on its import, a process)
import pytest

from distbelief.runtime.params import kernels, optim
from distbelief.runtime.params.optim import EPSILON, Adagrad, Sgd

MANY = 64 * 1024
# Around the compiled loops' vector widths (4 to 16 float32 lanes), and longer.
SIZES = [1, 10, 15, 16, 17, 33, MANY - 1, MANY + 1, 3 * MANY + 17]
LR = 0.05
PUSHES = 5


def gradients(size: int, pushes: int = PUSHES, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) * np.float32(2.0) for _ in range(pushes)]


def reference_sgd(params: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    p = params.astype(np.float64)
    for g in grads:
        p = p - LR * g.astype(np.float64)
    return p


def reference_adagrad(params: np.ndarray, grads: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    p, acc = params.astype(np.float64), np.zeros(params.size)
    for g in grads:
        g = g.astype(np.float64)
        acc = acc + g * g
        p = p - LR * g / (np.sqrt(acc) + EPSILON)
    return p, acc


@pytest.mark.parametrize("size", SIZES)
def test_sgd_matches_reference(size):
    start = np.random.default_rng(1).standard_normal(size).astype(np.float32)
    params, grads = start.copy(), gradients(size)
    opt = Sgd(size, LR)
    for g in grads:
        opt.apply(params, g)
    assert params.dtype == np.float32
    np.testing.assert_allclose(params, reference_sgd(start, grads), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("size", SIZES)
def test_adagrad_matches_reference(size):
    start = np.random.default_rng(1).standard_normal(size).astype(np.float32)
    params, grads = start.copy(), gradients(size)
    opt = Adagrad(size, LR)
    for g in grads:
        opt.apply(params, g)
    expected, expected_acc = reference_adagrad(start, grads)
    assert params.dtype == np.float32
    np.testing.assert_allclose(params, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(opt.accumulator, expected_acc, rtol=1e-5)


def awkward_values(size: int, seed: int) -> np.ndarray:
    """float32 values of every magnitude: exact zeros, subnormals, tiny, ordinary and large
    enough that their square overflows to inf, of both signs."""
    rng = np.random.default_rng(seed)
    magnitudes = 10.0 ** rng.uniform(-44, 25, size)
    values = (np.sign(rng.standard_normal(size)) * magnitudes).astype(np.float32)
    values[::7] = -1.5  # ordinary: each rule moves it
    values[1::7] = 3e19  # squared: inf
    values[2::7] = -1e-40  # subnormal
    values[3::7] = 0.0
    return values


def numpy_sgd(params: np.ndarray, grad: np.ndarray) -> None:
    params -= grad * np.float32(LR)


def numpy_adagrad(params: np.ndarray, accumulator: np.ndarray, grad: np.ndarray) -> None:
    """Adagrad in numpy's float32 ufuncs, one operation at a time in the formula's order."""
    accumulator += grad * grad
    params -= grad / (np.sqrt(accumulator) + np.float32(EPSILON)) * np.float32(LR)


@pytest.mark.floors  # numba's and numpy's lowest versions too
@pytest.mark.parametrize("size", SIZES)
def test_the_compiled_rules_give_numpys_float32_results_bit_for_bit(size):
    start = awkward_values(size, seed=1)
    sgd, adagrad = Sgd(size, LR), Adagrad(size, LR)
    sgd_params, adagrad_params = start.copy(), start.copy()
    numpy_sgd_params, numpy_params, numpy_accumulator = start.copy(), start.copy(), np.zeros(size, np.float32)
    with np.errstate(over="ignore", under="ignore"):  # a large gradient's square is inf: the rule's own result
        for push in range(PUSHES):
            grad = awkward_values(size, seed=10 + push)
            sgd.apply(sgd_params, grad)
            numpy_sgd(numpy_sgd_params, grad)
            adagrad.apply(adagrad_params, grad)
            numpy_adagrad(numpy_params, numpy_accumulator, grad)
    np.testing.assert_array_equal(sgd_params, numpy_sgd_params)
    np.testing.assert_array_equal(adagrad.accumulator, numpy_accumulator)
    np.testing.assert_array_equal(adagrad_params, numpy_params)
    assert not np.array_equal(adagrad_params, start)


def test_a_gradient_received_into_read_only_memory_is_applied():
    """A push's gradient may be a read-only view of the received frame."""
    grad = np.ones(100, np.float32)
    grad.flags.writeable = False
    for rule in (Sgd(100, LR), Adagrad(100, LR)):
        params = np.zeros(100, np.float32)
        rule.apply(params, grad)
        np.testing.assert_allclose(params, -LR, rtol=1e-6)


def test_a_gradient_of_another_type_is_refused_not_converted():
    with pytest.raises(TypeError, match="float64"):
        Adagrad(10, LR).apply(np.zeros(10, np.float32), np.ones(10))


def test_a_loop_compiles_where_numba_finds_no_folder_for_its_cache():
    """Source with no file behind it, as a module in a read-only tree with no writable
    cache folder: numba cannot cache it, and the loop still compiles, uncached."""
    namespace: dict = {}
    exec("def double(values):\n    for i in range(values.size):\n        values[i] *= 2\n", namespace)
    with pytest.raises(RuntimeError, match="no locator available"):
        numba.njit(cache=True)(namespace["double"])  # the case is real
    double = kernels.compiled(numba.types.void(kernels.VALUES))(namespace["double"])
    values = np.arange(20, dtype=np.float32)
    double(values)
    np.testing.assert_array_equal(values, 2 * np.arange(20, dtype=np.float32))


def test_adagrad_first_step_moves_each_parameter_by_the_learning_rate():
    """After one push, g / (sqrt(g^2) + eps) ~ sign(g): every coordinate moves by ~lr."""
    size = 2 * MANY + 3
    params, (g,) = np.zeros(size, dtype=np.float32), gradients(size, pushes=1)
    Adagrad(size, LR).apply(params, g)
    g64 = g.astype(np.float64)
    np.testing.assert_allclose(params, -LR * g64 / (np.abs(g64) + EPSILON), rtol=1e-5)
    big = np.abs(g) > 1e-2
    assert big.mean() > 0.99
    np.testing.assert_allclose(np.abs(params[big]), LR, rtol=1e-5)


def test_adagrad_rates_shrink_with_accumulated_gradient():
    size = 10
    params, opt = np.zeros(size, dtype=np.float32), Adagrad(size, LR)
    g = np.ones(size, dtype=np.float32)
    steps = []
    for _ in range(4):
        before = params.copy()
        opt.apply(params, g)
        steps.append(float(before[0] - params[0]))
    np.testing.assert_allclose(steps, [LR / np.sqrt(k) for k in (1, 2, 3, 4)], rtol=1e-5)


@pytest.mark.parametrize("make", [Sgd, Adagrad])
def test_apply_updates_a_slice_in_place_and_nothing_around_it(make):
    size = MANY + 5
    buffer = np.full(size + 20, 3.0, dtype=np.float32)
    view = buffer[10:10 + size]
    (g,) = gradients(size, pushes=1)
    make(size, LR).apply(view, g)
    assert np.all(buffer[:10] == 3.0) and np.all(buffer[10 + size:] == 3.0)
    assert np.all(view != 3.0)


@pytest.mark.parametrize("make", [Sgd, Adagrad])
def test_apply_leaves_the_gradient_alone(make):
    size = MANY + 5
    (g,) = gradients(size, pushes=1)
    saved = g.copy()
    make(size, LR).apply(np.zeros(size, dtype=np.float32), g)
    np.testing.assert_array_equal(g, saved)


def test_adagrad_state_round_trip():
    size = 3 * MANY + 17
    grads = gradients(size, pushes=4)
    params = np.zeros(size, dtype=np.float32)
    original = Adagrad(size, LR)
    for g in grads[:3]:
        original.apply(params, g)
    state = {k: v.copy() for k, v in original.state().items()}  # as a checkpoint would hold it
    assert list(state) == ["adagrad_accumulator"]
    restored = Adagrad(size, LR)
    restored.load_state(state)
    np.testing.assert_array_equal(restored.accumulator, original.accumulator)
    state["adagrad_accumulator"][:] = 0  # loading copied, not aliased
    assert np.any(restored.accumulator)
    a, b = params.copy(), params.copy()
    original.apply(a, grads[3])
    restored.apply(b, grads[3])
    np.testing.assert_array_equal(a, b)


def test_adagrad_state_is_the_live_accumulator():
    opt = Adagrad(10, LR)
    opt.apply(np.zeros(10, dtype=np.float32), np.ones(10, dtype=np.float32))
    np.testing.assert_array_equal(opt.state()["adagrad_accumulator"], np.ones(10))


def test_adagrad_load_state_of_another_size_is_an_error():
    with pytest.raises(ValueError, match="another size"):
        Adagrad(10, LR).load_state({"adagrad_accumulator": np.zeros(11, dtype=np.float32)})


def test_sgd_has_no_state():
    opt = Sgd(10, LR)
    assert opt.state() == {}
    opt.load_state({})  # accepted: nothing to restore
    params = np.zeros(10, dtype=np.float32)
    opt.apply(params, np.ones(10, dtype=np.float32))
    np.testing.assert_allclose(params, -LR)


@pytest.mark.parametrize("name, kind", [("adagrad", Adagrad), ("sgd", Sgd)])
def test_make_optimizer_by_name(name, kind):
    opt = optim.make_optimizer(name, 100, learning_rate=0.3)
    assert type(opt) is kind and opt.name == name
    assert opt.learning_rate == np.float32(0.3)


def test_an_unknown_optimizer_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown optimizer 'adam' \\(known: adagrad, sgd\\)"):
        optim.make_optimizer("adam", 10, learning_rate=0.1)


def test_the_crd_offers_exactly_the_registered_optimizers():
    from distbelief.operator.validation import spec

    training = spec.openapi_schema()["properties"]["spec"]["properties"]["training"]["properties"]
    assert sorted(training["optimizer"]["enum"]) == sorted(optim.OPTIMIZERS)


@pytest.mark.parametrize("make", [Sgd, Adagrad])
def test_apply_allocates_no_model_sized_temporary(make):
    size = 4 * 1024 * 1024  # 16 MiB of float32
    buffer = np.zeros(size + 2, dtype=np.float32)
    params = buffer[1:-1]  # a shard's slice of a bigger vector
    grad = np.random.default_rng(0).standard_normal(size, dtype=np.float32)
    opt = make(size, LR)
    tracemalloc.start()
    try:
        # The measurement can fail: a naive update's temporary is seen.
        naive = params - grad * np.float32(LR)
        _, naive_peak = tracemalloc.get_traced_memory()
        del naive
        tracemalloc.reset_peak()
        opt.apply(params, grad)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert naive_peak >= size * 4
    assert peak < 1 << 20, f"apply allocated {peak} bytes at peak"
    assert params[0] != 0  # it did update


# -- parts on threads ---------------------------------------------------------------------

@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("make", [Sgd, Adagrad])
def test_an_update_cut_over_threads_equals_the_one_thread_update_bit_for_bit(make, threads):
    size = 7 * MANY + 13  # parts of uneven length
    start = np.random.default_rng(1).standard_normal(size).astype(np.float32)
    one, many = start.copy(), start.copy()
    one_rule, many_rule = make(size, LR, threads=1), make(size, LR, threads=threads)
    for g in gradients(size, pushes=3):
        one_rule.apply(one, g)
        many_rule.apply(many, g)
    np.testing.assert_array_equal(many, one)
    np.testing.assert_array_equal(many_rule.state().get("adagrad_accumulator"),
                                  one_rule.state().get("adagrad_accumulator"))


def test_the_parts_cover_the_slice_once_and_run_on_threads_of_their_own():
    import threading

    parts = optim.Parts(5 * MANY + 1, threads=3)
    covered = np.zeros(5 * MANY + 1, dtype=np.int32)
    ran_on = set()

    def kernel(start: int, stop: int) -> None:
        covered[start:stop] += 1
        ran_on.add(threading.get_ident())

    parts.run(kernel)
    assert np.all(covered == 1)
    assert len(parts.parts) == 3 and len(ran_on) >= 2  # the caller and at least one pool thread


def test_a_small_slice_stays_on_the_calling_thread():
    assert len(optim.Parts(2 * optim.MIN_VALUES_PER_THREAD - 1).parts) == 1


@pytest.mark.parametrize("cpu_max, limit", [("150000 100000", 2), ("50000 100000", 1), ("max 100000", None),
                                            ("garbage", None), (None, None)])
def test_usable_cpus_is_the_affinity_cut_to_the_cgroup_quota(tmp_path, cpu_max, limit):
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max + "\n")
    affinity = len(os.sched_getaffinity(0))
    expected = affinity if limit is None else min(affinity, limit)
    assert optim.usable_cpus(path) == expected


@pytest.mark.parametrize("given, expected", [("1", 1), ("3", 3), ("0", None), ("lots", None), (None, None)])
def test_the_pod_s_cpus_are_those_the_operator_gave_its_blas(monkeypatch, given, expected):
    if given is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
    assert optim.pod_cpus() == (expected or optim.usable_cpus())
    size = optim.MAX_THREADS * optim.MIN_VALUES_PER_THREAD
    assert len(optim.Parts(size).parts) == min(optim.MAX_THREADS, optim.pod_cpus())
