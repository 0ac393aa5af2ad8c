"""Unit tests of distbelief.runtime.model.data (sources, split, minibatches) and of the parts of
distbelief.runtime.contract the roles parse at start-up."""

from __future__ import annotations

import json

import numpy as np
import pytest

from distbelief.runtime import contract, errors, jobbase, jobspec
from distbelief.runtime.contract import JobConfig
from distbelief.runtime.model import data


def ids_dataset(n: int = 200, test_fraction: float = 0.2, seed: int = 0) -> data.Dataset:
    """Rows that carry their own index, so where every row went can be checked."""
    x = np.arange(n, dtype=np.float32)[:, None]
    return data.split(x, np.arange(n) % 4, test_fraction=test_fraction, seed=seed)


def ids(x: np.ndarray) -> set[int]:
    return set(x[:, 0].astype(int).tolist())


# --- builtin:digits ----------------------------------------------------------------------

def test_builtin_digits():
    x, y = data.load_source("builtin:digits")
    assert x.shape == (1797, 64) and x.dtype == np.float32 and x.flags.c_contiguous
    assert y.shape == (1797,) and y.dtype == np.int64
    assert x.min() == 0.0 and x.max() == 1.0
    assert sorted(set(y.tolist())) == list(range(10))
    assert np.all(np.bincount(y) > 150)  # ~180 of each digit


def test_load_digits_splits_by_test_fraction():
    ds = data.load(jobspec.Data(source="builtin:digits", test_fraction=0.25, seed=3))
    assert ds.n_classes == 10 and ds.n_features == 64
    assert len(ds.x_test) == round(1797 * 0.25) and len(ds.x_train) == 1797 - round(1797 * 0.25)
    assert len(ds.y_train) == len(ds.x_train) and len(ds.y_test) == len(ds.x_test)


def test_load_defaults_to_a_fifth_held_out():
    ds = data.load(jobspec.Data(source="builtin:digits"))
    assert len(ds.x_test) == round(1797 * 0.2)
    again = data.load(jobspec.Data(source="builtin:digits", test_fraction=0.2, seed=0))
    np.testing.assert_array_equal(ds.x_test, again.x_test)


# --- split -------------------------------------------------------------------------------

def test_split_is_deterministic_in_the_seed():
    first, second = ids_dataset(seed=5), ids_dataset(seed=5)
    for a, b in zip(parts(first), parts(second)):
        np.testing.assert_array_equal(a, b)


def parts(ds: data.Dataset):
    return ds.x_train, ds.y_train, ds.x_test, ds.y_test


def test_split_is_disjoint_and_covers_everything():
    ds = ids_dataset(n=200)
    train, test = ids(ds.x_train), ids(ds.x_test)
    assert len(train) == len(ds.x_train) and len(test) == len(ds.x_test)  # no duplicates
    assert not train & test
    assert train | test == set(range(200))
    np.testing.assert_array_equal(ds.y_train, ds.x_train[:, 0].astype(int) % 4)  # labels follow rows
    np.testing.assert_array_equal(ds.y_test, ds.x_test[:, 0].astype(int) % 4)


@pytest.mark.parametrize("n, fraction, n_test", [
    (200, 0.2, 40), (200, 0.1, 20), (200, 0.5, 100), (101, 0.25, 25), (10, 0.01, 1), (1797, 0.3, 539),
])
def test_split_sizes_follow_test_fraction(n, fraction, n_test):
    ds = ids_dataset(n=n, test_fraction=fraction)
    assert len(ds.x_test) == n_test
    assert len(ds.x_train) == n - n_test


@pytest.mark.parametrize("n, fraction", [(1, 0.2), (2, 0.9), (0, 0.2)])
def test_split_that_leaves_nothing_to_train_on_is_a_config_error(n, fraction):
    """A tiny npz file, or a large testFraction, must not reach the replicas with an empty
    training part (their minibatch stream cannot draw from it)."""
    with pytest.raises(errors.ConfigError, match="spec.data.testFraction: .* leaves none to train on"):
        data.split(np.zeros((n, 2), np.float32), np.zeros(n, dtype=np.int64), test_fraction=fraction, seed=0)


def test_split_keeps_a_single_training_example():
    ds = data.split(np.zeros((10, 2), np.float32), np.arange(10) % 2, test_fraction=0.9, seed=0)
    assert len(ds.x_train) == 1 and len(ds.x_test) == 9
    x, _ = next(data.minibatches(ds, 32, np.random.default_rng(0)))
    assert len(x) == 1


def test_split_differs_with_the_seed():
    a, b = ids_dataset(seed=1), ids_dataset(seed=2)
    assert ids(a.x_test) != ids(b.x_test)


def test_split_is_shuffled():
    ds = ids_dataset(n=200)
    assert ids(ds.x_test) != set(range(40)) and ids(ds.x_test) != set(range(160, 200))


def test_n_classes_is_one_more_than_the_largest_label():
    ds = data.split(np.zeros((10, 2), np.float32), np.array([0, 1, 6] + [2] * 7), test_fraction=0.2, seed=0)
    assert ds.n_classes == 7 and ds.n_features == 2


# --- synthetic ---------------------------------------------------------------------------

def test_synthetic_shapes_and_types():
    x, y = data.load_source("synthetic:features=12,classes=4,samples=500")
    assert x.shape == (500, 12) and x.dtype == np.float32
    assert y.shape == (500,) and y.dtype == np.int64
    assert y.min() >= 0 and y.max() < 4
    assert len(set(y.tolist())) == 4


def test_synthetic_is_deterministic_and_seeded():
    a = data.load_source("synthetic:features=8,classes=3,samples=100")
    b = data.load_source("synthetic:features=8,classes=3,samples=100,seed=0")
    c = data.load_source("synthetic:features=8,classes=3,samples=100,seed=1")
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


def test_synthetic_labels_are_learnable():
    """A least-squares linear classifier fitted on the training part beats chance (1/5)
    by a wide margin on the held-out part."""
    ds = data.load(jobspec.Data(source="synthetic:features=20,classes=5,samples=3000", test_fraction=0.25, seed=0))
    assert ds.n_classes == 5 and ds.n_features == 20
    weights, *_ = np.linalg.lstsq(ds.x_train.astype(np.float64), np.eye(5)[ds.y_train], rcond=None)
    accuracy = np.mean(np.argmax(ds.x_test @ weights, axis=1) == ds.y_test)
    assert accuracy > 0.7
    # and the labels are not a constant or one dominating class
    assert np.max(np.bincount(ds.y_test)) < 0.5 * len(ds.y_test)


@pytest.mark.parametrize("body, fragment", [
    ("features=0,classes=3,samples=100", "features must be within"),
    ("features=3,classes=3", "samples required"),
    ("features=3,classes=3,samples=100,colour=2", "unknown parameter 'colour'"),
    ("features=3,classes=x,samples=100", "classes must be an integer"),
])
def test_bad_synthetic_parameters_are_a_config_error(body, fragment):
    with pytest.raises(errors.ConfigError, match=f"spec.data.source: .*{fragment}"):
        data.load_source(f"synthetic:{body}")


# --- npz ---------------------------------------------------------------------------------

def test_npz_loads(tmp_path):
    path = tmp_path / "train.npz"
    x = np.random.default_rng(0).random((30, 4))  # float64 on disk
    y = np.arange(30, dtype=np.int32) % 3
    np.savez(path, x=x, y=y)
    lx, ly = data.load_source(f"npz:{path}")
    assert lx.dtype == np.float32 and ly.dtype == np.int64
    np.testing.assert_allclose(lx, x, rtol=1e-6)
    np.testing.assert_array_equal(ly, y)
    ds = data.load(jobspec.Data(source=f"npz:{path}", test_fraction=0.2))
    assert ds.n_classes == 3 and len(ds.x_test) == 6


@pytest.mark.parametrize("arrays, fragment", [
    (dict(x=np.zeros((5, 2))), "y"),
    (dict(y=np.zeros(5, dtype=int)), "x"),
    (dict(features=np.zeros((5, 2)), labels=np.zeros(5, dtype=int)), "x"),
])
def test_npz_missing_arrays_is_a_config_error(tmp_path, arrays, fragment):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(errors.ConfigError) as info:
        data.load_source(f"npz:{path}")
    assert f"npz:{path}" in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize("x, y, fragment", [
    (np.zeros(5), np.zeros(5, dtype=int), "shape"),
    (np.zeros((5, 2, 2)), np.zeros(5, dtype=int), "shape"),
    (np.zeros((5, 2)), np.zeros((5, 1), dtype=int), "shape"),
    (np.zeros((5, 2)), np.zeros(4, dtype=int), "shape"),
    (np.zeros((5, 2)), np.array([0, 1, -1, 2, 0]), "non-negative integer"),
    (np.zeros((5, 2)), np.array([0.0, 1.0, 2.0, 1.0, 0.0]), "non-negative integer"),
    (np.zeros((5, 2)), np.array([0.5, 1.0, 2.0, 1.0, 0.0]), "non-negative integer"),
    (np.zeros((0, 2)), np.zeros(0, dtype=int), "no examples"),
])
def test_npz_bad_arrays_are_a_config_error_naming_the_path(tmp_path, x, y, fragment):
    path = tmp_path / "bad.npz"
    np.savez(path, x=x, y=y)
    with pytest.raises(errors.ConfigError, match=fragment) as info:
        data.load_source(f"npz:{path}")
    assert f"npz:{path}" in str(info.value)


@pytest.mark.parametrize("x, y, fragment", [
    (np.array([[0.0, 1.0], [np.nan, 2.0], [1.0, np.inf], [0.0, 0.0]]), np.array([0, 1, 0, 1]),
     r"x holds 2 non-finite values \(NaN or infinity\), the first in row 1"),
    (np.zeros((6, 2)), np.array([0, 1, 7, 0, 1, 7]), r"labels \{0, 1, 7\} leave out 2, 3, 4, 5, 6"),
    (np.zeros((4, 2)), np.array([1, 1, 2, 2]), r"labels \{1, 2\} leave out 0"),
    (np.zeros((4, 2)), np.array([3, 3, 3, 3]), "a single class"),
    (np.array([["a", "b"], ["c", "d"]]), np.array([0, 1]), "x must hold numbers"),
])
def test_npz_data_a_model_cannot_train_on_is_refused_in_one_line(tmp_path, x, y, fragment):
    path = tmp_path / "bad.npz"
    np.savez(path, x=x, y=y)
    with pytest.raises(errors.ConfigError, match=fragment) as info:
        data.load_source(f"npz:{path}")
    assert str(info.value).startswith(f"npz:{path}: ") and "\n" not in str(info.value)


def test_npz_missing_file_is_a_config_error(tmp_path):
    path = tmp_path / "nope.npz"
    with pytest.raises(errors.ConfigError, match="cannot read") as info:
        data.load_source(f"npz:{path}")
    assert f"npz:{path}" in str(info.value)


def test_npz_not_a_zip_is_a_config_error(tmp_path):
    path = tmp_path / "text.npz"
    path.write_text("not an archive")
    with pytest.raises(errors.ConfigError) as info:
        data.load_source(f"npz:{path}")
    assert f"npz:{path}" in str(info.value)


def test_npz_never_unpickles(tmp_path):
    """Object arrays are pickles: refused, not loaded."""
    path = tmp_path / "pickled.npz"
    np.savez(path, x=np.array([[{}], [{}]], dtype=object), y=np.array([0, 1]))
    with pytest.raises(errors.ConfigError) as info:
        data.load_source(f"npz:{path}")
    assert f"npz:{path}" in str(info.value)


@pytest.mark.parametrize("source, fragment", [
    ("s3:bucket/key", "unknown data source 's3:bucket/key'"),
    ("digits", "unknown data source 'digits'"),
    ("builtin:", "unknown data source 'builtin:'"),
    ("npz:", "unknown data source 'npz:'"),
    ("", "unknown data source ''"),
    ("builtin:mnist", "unknown built-in data set 'mnist' \\(known: digits\\)"),
])
def test_unknown_source_is_a_config_error(source, fragment):
    with pytest.raises(errors.ConfigError, match=f"spec.data.source: {fragment}"):
        data.load_source(source)


# --- minibatches -------------------------------------------------------------------------

def test_minibatches_come_from_the_training_part_only():
    ds = ids_dataset(n=200)
    train, test = ids(ds.x_train), ids(ds.x_test)
    stream = data.minibatches(ds, 32, np.random.default_rng(0))
    seen: set[int] = set()
    for _ in range(20):  # several epochs
        x, y = next(stream)
        assert x.shape == (32, 1) and y.shape == (32,)
        rows = x[:, 0].astype(int)
        np.testing.assert_array_equal(y, rows % 4)  # rows keep their labels
        assert ids(x) <= train and not ids(x) & test
        seen |= ids(x)
    assert seen == train  # every training example comes up


def test_minibatches_are_shuffled_epochs_without_repeats():
    ds = ids_dataset(n=200)  # 160 training rows: 5 batches of 32 per epoch
    stream = data.minibatches(ds, 32, np.random.default_rng(0))
    epoch = [next(stream) for _ in range(5)]
    rows = np.concatenate([x[:, 0] for x, _ in epoch]).astype(int)
    assert len(set(rows.tolist())) == 160
    assert not np.array_equal(rows, np.sort(rows))


def test_minibatches_drop_the_ragged_tail_of_an_epoch():
    ds = ids_dataset(n=200)  # 160 training rows
    stream = data.minibatches(ds, 50, np.random.default_rng(0))
    first_epoch = [next(stream) for _ in range(3)]
    rows = np.concatenate([x[:, 0] for x, _ in first_epoch]).astype(int)
    assert len(set(rows.tolist())) == 150
    assert all(len(x) == 50 for x, _ in first_epoch)
    assert len(next(stream)[0]) == 50  # the next epoch starts, no batch of 10


def test_minibatches_larger_than_the_training_part_are_clamped():
    ds = ids_dataset(n=20)  # 16 training rows
    x, y = next(data.minibatches(ds, 1000, np.random.default_rng(0)))
    assert len(x) == len(y) == 16 and ids(x) == ids(ds.x_train)


def test_minibatch_streams_depend_on_the_seed():
    ds = ids_dataset(n=200)
    a = data.minibatches(ds, 16, np.random.default_rng(1))
    b = data.minibatches(ds, 16, np.random.default_rng(2))
    c = data.minibatches(ds, 16, np.random.default_rng(1))
    first_a, first_b, first_c = next(a)[0], next(b)[0], next(c)[0]
    assert not np.array_equal(first_a, first_b)
    np.testing.assert_array_equal(first_a, first_c)


# --- contract: durations, pod names, shard addresses, the config file --------------------

@pytest.mark.parametrize("text, seconds", [
    ("90s", 90.0), ("1h30m", 5400.0), ("250ms", 0.25), ("1.5h", 5400.0), ("2m30s", 150.0),
    ("1h0m5s", 3605.0), ("0.5s", 0.5), ("1m500ms", 60.5), ("10m", 600.0), ("3h", 10800.0),
])
def test_parse_duration(text, seconds):
    assert jobbase.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["10", "abc", "5x", "h", "1d", "-5s", "5 s", "1h30", "s5", "1.5", "ms"])
def test_parse_duration_errors(text):
    with pytest.raises(ValueError, match="not a duration"):
        jobbase.parse_duration(text)


@pytest.mark.parametrize("pod, index", [("train-ps-0", 0), ("my-job-ps-12", 12), ("a-7", 7), ("x-ps-007", 7)])
def test_shard_index_from_pod_name(pod, index):
    assert contract.shard_index_from_pod_name(pod) == index


@pytest.mark.parametrize("pod", ["train-ps", "train-ps-", "train-ps-a1", "", "train-worker-5d8f-x2z"])
def test_shard_index_from_a_bad_pod_name(pod):
    with pytest.raises(ValueError, match="cannot read a shard index"):
        contract.shard_index_from_pod_name(pod)


def job_config(shards: int = 3) -> JobConfig:
    return JobConfig(name="train", namespace="ml", written={
        "parameterServers": {"shards": shards, "port": 5555},
        "training": {"algorithm": "downpour", "learningRate": 0.05, "maxDuration": "1h"},
        "data": {"source": "builtin:digits"},
    })


def test_shard_addresses_from_the_headless_service():
    assert job_config().shard_addresses({}) == [
        "tcp://train-ps-0.train-ps.ml.svc:5555",
        "tcp://train-ps-1.train-ps.ml.svc:5555",
        "tcp://train-ps-2.train-ps.ml.svc:5555",
    ]


def test_shard_addresses_override():
    env = {contract.ENV_PS_ADDRESSES: " tcp://127.0.0.1:7001, tcp://127.0.0.1:7002 ,tcp://127.0.0.1:7003,"}
    assert job_config().shard_addresses(env) == [
        "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002", "tcp://127.0.0.1:7003"]


def test_blank_override_falls_back_to_the_service():
    assert job_config(1).shard_addresses({contract.ENV_PS_ADDRESSES: "  "}) == ["tcp://train-ps-0.train-ps.ml.svc:5555"]


def test_shard_addresses_read_the_process_environment(monkeypatch):
    monkeypatch.setenv("DISTBELIEF_PS_ADDRESSES", "tcp://127.0.0.1:1,tcp://127.0.0.1:2")
    assert job_config(2).shard_addresses() == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    monkeypatch.delenv("DISTBELIEF_PS_ADDRESSES")
    assert job_config(2).shard_addresses()[1] == "tcp://train-ps-1.train-ps.ml.svc:5555"


@pytest.mark.parametrize("listed", ["tcp://a:1,tcp://b:2", "tcp://a:1,tcp://b:2,tcp://c:3,tcp://d:4"])
def test_shard_addresses_count_mismatch_is_an_error(listed):
    count = len(listed.split(","))
    with pytest.raises(ValueError, match=f"DISTBELIEF_PS_ADDRESSES lists {count} addresses, but the job has 3 shards"):
        job_config(3).shard_addresses({contract.ENV_PS_ADDRESSES: listed})


def test_job_config_json_round_trip(tmp_path):
    config = job_config()
    text = config.to_json()
    doc = json.loads(text)
    assert doc["apiVersion"] == "distbelief.io/v1alpha1" and doc["kind"] == "JobConfig"
    assert doc["name"] == "train" and doc["namespace"] == "ml"
    assert JobConfig.from_json(text) == config
    path = tmp_path / contract.CONFIG_KEY
    path.write_text(text, encoding="utf-8")
    loaded = JobConfig.load(str(path))
    assert loaded == config
    assert (loaded.spec.parameter_servers.shards, loaded.spec.parameter_servers.port) == (3, 5555)
    assert loaded.names.ps == "train-ps" and loaded.names.shard_pod(2) == "train-ps-2"
