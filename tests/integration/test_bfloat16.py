"""The bfloat16 wire format (spec.parameterServers.wireFormat): the conversions, and shards
that take bfloat16 pushes and refuse pushes in the other format."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from distbelief.runtime import errors
from distbelief.runtime.params import dense
from distbelief.runtime.params.dense_client import Bfloat16Dense, Float32Dense
from distbelief.runtime.params.optim import Adagrad
from distbelief.runtime.wire.bfloat16 import BLOCK, WIRE_DTYPE, Codec
from distbelief.runtime.wire.layout import Layout

from support.shards import LiveShards, start_shards


def narrow(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=np.float32)
    return Codec(values.size).narrow(values, np.empty(values.size, WIRE_DTYPE))


def widen(wire: np.ndarray) -> np.ndarray:
    return Codec.widen(wire, np.empty(wire.size, np.float32))


def from_bits(*bits: int) -> np.ndarray:
    return np.array(bits, dtype=np.uint32).view(np.float32)


# -- the conversions --------------------------------------------------------------------------


def test_every_finite_bfloat16_survives_the_round_trip_exactly() -> None:
    every = np.arange(1 << 16, dtype=np.uint32).astype(WIRE_DTYPE)
    finite = every[(every & 0x7F80) != 0x7F80]  # exponent all ones: inf and NaN, below
    values = widen(finite)
    assert np.isfinite(values).all()
    np.testing.assert_array_equal(narrow(values), finite)


@pytest.mark.parametrize("bits, expected", [
    (0x3F800000, 0x3F80),  # 1.0: exact
    (0x3F807FFF, 0x3F80),  # just below half an ulp: down
    (0x3F808001, 0x3F81),  # just above: up
    (0x3F808000, 0x3F80),  # a tie, the kept bit even: stays
    (0x3F818000, 0x3F82),  # a tie, the kept bit odd: up to even
    (0xBF818000, 0xBF82),  # the same below zero
    (0x3FFF8000, 0x4000),  # a tie whose carry moves into the exponent
    (0x00018000, 0x0002),  # a subnormal tie
    (0x7F7FFFFF, 0x7F80),  # the largest float32 is past the largest bfloat16: inf
])
def test_narrowing_rounds_to_nearest_even(bits: int, expected: int) -> None:
    assert narrow(from_bits(bits))[0] == expected


def test_narrowing_is_within_two_to_the_minus_eight_on_random_data() -> None:
    rng = np.random.default_rng(3)
    values = (rng.standard_normal(BLOCK * 2 + 17) * 10.0 ** rng.integers(-30, 30, BLOCK * 2 + 17)).astype(np.float32)
    relative = np.abs(widen(narrow(values)) - values) / np.abs(values)
    assert relative.max() <= 2.0 ** -8
    assert relative.max() > 2.0 ** -9  # the check above measures rounding, not a copy


def test_inf_stays_inf_and_every_nan_stays_nan() -> None:
    values = from_bits(0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                       0x7F800001)  # a NaN whose high half alone reads as inf
    back = widen(narrow(values))
    assert back[0] == np.inf and back[1] == -np.inf
    assert np.isnan(back[2:]).all()


def test_narrowing_into_the_arrays_own_memory_gives_the_same_bits() -> None:
    values = np.random.default_rng(4).standard_normal(BLOCK * 3 + 5).astype(np.float32)
    expected = narrow(values)
    in_place = Codec(values.size).narrow(values, values.view(WIRE_DTYPE)[:values.size])
    np.testing.assert_array_equal(in_place, expected)


def test_conversions_refuse_arrays_of_another_type_or_size() -> None:
    with pytest.raises(ValueError, match="float32 into as many uint16"):
        Codec(4).narrow(np.zeros(4, np.float64), np.empty(4, WIRE_DTYPE))
    with pytest.raises(ValueError, match="uint16 into as many float32"):
        Codec.widen(np.zeros(4, WIRE_DTYPE), np.empty(3, np.float32))


# -- shards with each format ------------------------------------------------------------------


LAYOUT = Layout.of([("w", (10, 7)), ("b", (7,))], shards=2)
INITIAL = np.linspace(-1, 1, LAYOUT.total, dtype=np.float32)


@pytest.fixture
def bfloat16_shards(tmp_path: Path) -> Iterator[LiveShards]:
    live = start_shards(tmp_path, LAYOUT, INITIAL, learning_rate=0.5, wire_format="bfloat16", checkpoint_every=3600)
    yield live
    live.stop()


@pytest.fixture
def float32_shards(tmp_path: Path) -> Iterator[LiveShards]:
    live = start_shards(tmp_path, LAYOUT, INITIAL, learning_rate=0.5, checkpoint_every=3600)
    yield live
    live.stop()


def master_weights(live: LiveShards) -> np.ndarray:
    return np.concatenate([live.params(i) for i in range(LAYOUT.shards)])


def test_a_bfloat16_pull_brings_the_rounded_parameters_and_a_float32_pull_the_exact_ones(
        bfloat16_shards: LiveShards) -> None:
    group = bfloat16_shards.group()
    out = np.zeros(LAYOUT.total, np.float32)
    Bfloat16Dense(group).pull(out)
    np.testing.assert_array_equal(out, widen(narrow(INITIAL)))
    assert not np.array_equal(out, INITIAL)
    Float32Dense(group).pull(out)
    np.testing.assert_array_equal(out, INITIAL)


def test_bfloat16_pushes_are_applied_in_float32_to_float32_master_weights(bfloat16_shards: LiveShards) -> None:
    wire = Bfloat16Dense(bfloat16_shards.group())
    expected, reference = INITIAL.copy(), Adagrad(LAYOUT.total, 0.5)
    rng = np.random.default_rng(5)
    out = np.empty(LAYOUT.total, np.float32)
    for step in range(3):
        grad = rng.standard_normal(LAYOUT.total).astype(np.float32)
        reference.apply(expected, widen(narrow(grad)))
        replies = wire.push_and_pull(grad, out, steps=[step, step], examples=8, loss=1.0)
    assert [r.step for r in replies] == [3, 3]
    master = master_weights(bfloat16_shards)
    assert master.dtype == np.float32
    np.testing.assert_allclose(master, expected, rtol=1e-6)
    np.testing.assert_array_equal(out, widen(narrow(master)))  # PUSH_PULL_BF16 answers in bfloat16 too


def test_a_bfloat16_shard_refuses_a_float32_push_and_applies_nothing(bfloat16_shards: LiveShards) -> None:
    with pytest.raises(errors.ShardRefused, match=r"PUSH carries a float32 gradient, but this job's "
                                                  r"spec.parameterServers.wireFormat is bfloat16"):
        Float32Dense(bfloat16_shards.group()).push(np.ones(LAYOUT.total, np.float32), steps=[0, 0], examples=1,
                                                   loss=1.0)
    np.testing.assert_array_equal(master_weights(bfloat16_shards), INITIAL)


def test_a_float32_shard_refuses_a_bfloat16_push_and_applies_nothing(float32_shards: LiveShards) -> None:
    wire = Bfloat16Dense(float32_shards.group())
    with pytest.raises(errors.ShardRefused, match=r"PUSH_PULL_BF16 carries a bfloat16 gradient, but this job's "
                                                  r"spec.parameterServers.wireFormat is float32"):
        wire.push_and_pull(np.ones(LAYOUT.total, np.float32), np.empty(LAYOUT.total, np.float32), steps=[0, 0],
                           examples=1, loss=1.0)
    np.testing.assert_array_equal(master_weights(float32_shards), INITIAL)


def test_float32_values_under_a_bfloat16_header_are_refused_not_read(bfloat16_shards: LiveShards) -> None:
    group = bfloat16_shards.group()
    with pytest.raises(errors.ShardRefused, match=r"bytes but the header declares \d+ bfloat16 values"):
        group.request(dense.PUSH_BF16, array=np.ones(LAYOUT.total, np.float32), steps=[0, 0],
                      meta=dense.Update(examples=1, loss=1.0))
    np.testing.assert_array_equal(master_weights(bfloat16_shards), INITIAL)


def test_a_non_finite_bfloat16_gradient_is_refused(bfloat16_shards: LiveShards) -> None:
    grad = np.zeros(LAYOUT.total, np.float32)
    grad[3] = 3.4e38  # finite in float32, inf once rounded to bfloat16
    with pytest.raises(errors.ShardRefused, match="non-finite"):
        Bfloat16Dense(bfloat16_shards.group()).push(grad, steps=[0, 0], examples=1, loss=1.0)
    np.testing.assert_array_equal(master_weights(bfloat16_shards), INITIAL)
