"""A streaming replica's shuffle buffer (algorithms/feed/stream.py) when its examples carry
id columns (a model with embeddings): each example's ids stay with its features and label."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distbelief.runtime import errors, jobspec
from distbelief.runtime.algorithms.feed.stream import ShuffleBuffer, StreamedBatches
from distbelief.runtime.model.files import FileSet

FIELDS = 3


def unit_of(tag: int, n: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows numbered from tag * 100: feature 0 the number, label its parity, field f's id number * 10 + f."""
    number = np.arange(tag * 100, tag * 100 + n)
    ids = number[:, None] * 10 + np.arange(FIELDS)[None, :]
    return number.astype(np.float32)[:, None], number % 2, ids


def test_each_example_leaves_the_buffer_once_with_its_own_ids_even_past_its_first_capacity():
    buffer = ShuffleBuffer(1, np.random.default_rng(0), capacity=4, fields=FIELDS)
    for tag in range(3):
        x, y, ids = unit_of(tag)
        buffer.add(x, y, tag, ids)
    drawn = [buffer.take(8) for _ in range(4)]
    numbers = np.concatenate([d.x[:, 0] for d in drawn]).astype(np.int64)
    assert sorted(numbers.tolist()) == [t * 100 + i for t in range(3) for i in range(10)] and buffer.size == 0
    for d in drawn:
        number = d.x[:, 0].astype(np.int64)
        assert np.array_equal(d.ids, number[:, None] * 10 + np.arange(FIELDS)[None, :])
        assert np.array_equal(d.y, number % 2) and np.array_equal(d.tag, number // 100)
    assert numbers[:10].tolist() != list(range(10))   # shuffled, not in file order


def test_a_buffer_refuses_examples_whose_id_columns_it_does_not_carry():
    with_ids = ShuffleBuffer(1, np.random.default_rng(0), fields=FIELDS)
    x, y, ids = unit_of(0)
    with pytest.raises(ValueError, match="carry 3 id columns, these 0"):
        with_ids.add(x, y, 0)
    with pytest.raises(ValueError, match="carry 0 id columns, these 3"):
        ShuffleBuffer(1, np.random.default_rng(0)).add(x, y, 0, ids)


def test_without_ids_the_buffer_draws_zero_id_columns():
    buffer = ShuffleBuffer(1, np.random.default_rng(0))
    x, y, _ = unit_of(0)
    buffer.add(x, y, 0)
    assert buffer.take(4).ids.shape == (4, 0)


def test_streaming_ids_from_files_without_id_columns_is_a_config_error_naming_the_source(tmp_path: Path):
    for k in range(2):
        pq.write_table(pa.table({"a": np.arange(5.0), "y": np.arange(5) % 2}), tmp_path / f"p{k}.parquet")
    file_set = FileSet(jobspec.Data(source=f"parquet:{tmp_path}/*.parquet"))
    with pytest.raises(errors.ConfigError, match=r"spec.data.ids: parquet:.*\*.parquet is read without id columns"):
        StreamedBatches(file_set, link=None, batch_size=4, rng=np.random.default_rng(0), stop=threading.Event(),
                        with_ids=True)
