"""Unit tests of distbelief.runtime.wire.layout: the partition of the flat vector over the
shards and the layout hash every request carries."""

from __future__ import annotations

import numpy as np
import pytest

from distbelief.runtime.wire.layout import Layout

SHAPES = [("layer0.weight", (64, 32)), ("layer0.bias", (32,)), ("layer1.weight", (32, 10)), ("layer1.bias", (10,))]
TOTAL = 64 * 32 + 32 + 32 * 10 + 10


@pytest.mark.parametrize("total, shards", [
    (1, 1), (7, 1), (7, 7), (7, 3), (10, 4), (100, 3), (101, 10), (1_000_003, 7), (2**31 + 5, 9),
])
def test_partition_is_contiguous_exact_and_balanced(total, shards):
    layout = Layout.of([("w", (total,))], shards)
    assert layout.total == total
    bounds = [layout.bounds(i) for i in range(shards)]
    assert bounds[0][0] == 0
    assert bounds[-1][1] == total
    for (_, stop), (start, _) in zip(bounds, bounds[1:]):
        assert stop == start  # no gap, no overlap
    sizes = [layout.size(i) for i in range(shards)]
    assert sizes == [stop - start for start, stop in bounds]
    assert sum(sizes) == total
    assert min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1


def test_partition_over_several_arrays_covers_every_parameter_once():
    layout = Layout.of(SHAPES, 3)
    assert layout.total == TOTAL
    owner = np.full(TOTAL, -1)
    for shard in range(3):
        start, stop = layout.bounds(shard)
        assert np.all(owner[start:stop] == -1)
        owner[start:stop] = shard
    assert np.all(owner >= 0)
    assert np.all(np.diff(owner) >= 0)  # shards own ascending ranges


def test_partition_is_deterministic():
    first, second = Layout.of(SHAPES, 4), Layout.of([(n, list(s)) for n, s in SHAPES], 4)
    assert first == second
    assert [first.bounds(i) for i in range(4)] == [second.bounds(i) for i in range(4)]


def test_of_freezes_shapes_to_plain_int_tuples():
    layout = Layout.of([("w", [np.int64(3), np.int32(4)]), ("b", np.array([4]))], 2)
    assert layout.shapes == (("w", (3, 4)), ("b", (4,)))
    assert all(type(d) is int for _, shape in layout.shapes for d in shape)
    assert layout.hash == Layout.of([("w", (3, 4)), ("b", (4,))], 2).hash


def test_hash_is_a_stable_64_bit_number():
    layout = Layout.of(SHAPES, 3)
    assert isinstance(layout.hash, int) and 0 <= layout.hash < 2**64
    assert layout.hash == Layout.of(SHAPES, 3).hash


@pytest.mark.parametrize("changed", [
    pytest.param(Layout.of(SHAPES, 4), id="shard-count"),
    pytest.param(Layout.of([("layer0.weight", (32, 64)), *SHAPES[1:]], 3), id="same-size-other-shape"),
    pytest.param(Layout.of([("layer0.weight", (64, 33)), *SHAPES[1:]], 3), id="other-size"),
    pytest.param(Layout.of([SHAPES[1], SHAPES[0], *SHAPES[2:]], 3), id="order"),
    pytest.param(Layout.of([("layer0.w", (64, 32)), *SHAPES[1:]], 3), id="name"),
    pytest.param(Layout.of([*SHAPES, ("extra", (1,))], 3), id="extra-array"),
])
def test_hash_changes_with_the_layout(changed):
    original = Layout.of(SHAPES, 3)
    assert changed != original
    assert changed.hash != original.hash


@pytest.mark.parametrize("shards", [0, -1])
def test_no_shards_is_an_error(shards):
    with pytest.raises(ValueError, match="at least one shard"):
        Layout.of(SHAPES, shards)


def test_more_shards_than_parameters_is_an_error():
    with pytest.raises(ValueError, match="5 parameters cannot be split over 6 shards"):
        Layout.of([("w", (5,))], 6)
    assert Layout.of([("w", (5,))], 5).size(4) == 1  # exactly one each is fine


@pytest.mark.parametrize("shard", [-1, 3, 100])
def test_shard_index_out_of_range_is_an_error(shard):
    layout = Layout.of(SHAPES, 3)
    with pytest.raises(ValueError, match=f"shard {shard} is outside 0..2"):
        layout.bounds(shard)
    with pytest.raises(ValueError):
        layout.size(shard)
