"""Data sources, the deterministic train/held-out split, and per-replica minibatch streams.

Sources (spec.data.source):
    builtin:digits                      8x8 handwritten digits, 1,797 examples, 10 classes
                                        (datasets/digits.csv.gz: the test set of UCI's Optical
                                        Recognition of Handwritten Digits, CC BY 4.0)
    synthetic:features=F,classes=C,samples=N[,seed=S]
                                        Gaussian inputs labelled by a fixed random linear
                                        teacher: learnable, any size, no download
    synthetic-ctr:fields=F,ids=N,samples=S[,zipf=A][,seed=K][,missing=P]
                                        click-style data: per field an id in 0..N-1 drawn
                                        Zipf(A) (rank 0 the most common), a share P of them
                                        missing (-1), labels 0/1 drawn from a planted
                                        logistic model over per-(field, id) weights
    npz:/path/file.npz                  y (n,) integer labels, with x (n, features) and/or
                                        ids (n, fields) int64 categorical ids, -1 = missing
    parquet:, csv:, npy: and npz: globs many files, by column (files.py)

Every role that loads a source gets the same arrays and the same split (by the spec's
seed); each replica then draws its own random minibatches from the training part, so
replicas joining or leaving never bias what the model sees.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
from typing import Iterator

import numpy as np

from distbelief.runtime import contract, errors, jobspec
from distbelief.runtime.model import files
from distbelief.runtime.wire import rowkeys

MAX_ID = 1 << 56  # ids share a 63-bit key with their field's number (embedding.keys)
DIGITS = "builtin:digits"
DIGITS_MAX = 16.0  # the digits' pixel intensities run 0..16
MISSING_STREAM = 7  # synthetic-ctr's missing ids come from the generator seeded [seed, MISSING_STREAM]


@dataclasses.dataclass(frozen=True)
class Dataset:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    n_classes: int
    ids_train: np.ndarray | None = None   # int64 [n, fields], -1 = missing; None without ids
    ids_test: np.ndarray | None = None

    @property
    def fields(self) -> int:
        return 0 if self.ids_train is None else int(self.ids_train.shape[1])

    @property
    def n_features(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def nbytes(self) -> int:
        """The memory its arrays hold."""
        arrays = (self.x_train, self.y_train, self.x_test, self.y_test, self.ids_train, self.ids_test)
        return sum(a.nbytes for a in arrays if a is not None)


def load(spec: jobspec.Data) -> Dataset:
    """The split data set a job's spec.data describes."""
    if files.is_file_set(spec.source):
        return load_files(files.FileSet(spec))
    x, y, ids = read_source(spec.source)
    return split(x, y, ids=ids, test_fraction=spec.test_fraction, seed=spec.seed)


def load_files(file_set: files.FileSet) -> Dataset:
    """A file source's training and held-out files, read whole into memory."""
    x_train, y_train, ids_train = file_set.read_all(file_set.train_units)
    x_test, y_test, ids_test = file_set.read_all(file_set.test_units)
    return Dataset(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test, n_classes=file_set.n_classes,
                   ids_train=ids_train, ids_test=ids_test)


def held_out_only(file_set: files.FileSet, limit: int) -> Dataset:
    """A file source's held-out files, at most `limit` examples, and no training part."""
    x_test, y_test, ids_test = file_set.read_all(file_set.test_units, limit=limit)
    return Dataset(x_train=x_test[:0], y_train=y_test[:0], x_test=x_test, y_test=y_test,
                   n_classes=file_set.n_classes, ids_train=None if ids_test is None else ids_test[:0], ids_test=ids_test)


def load_source(source: str) -> tuple[np.ndarray, np.ndarray]:
    """A source's dense features, preprocessed as training uses them, and its labels."""
    x, y, _ = read_source(source)
    return x, y


def read_source(source: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A source's dense features (preprocessed; possibly 0 columns), labels, and ids if it has them."""
    x, y, ids = _raw(source)
    return (_as_features(source, x), np.ascontiguousarray(y, dtype=np.int64),
            None if ids is None else np.ascontiguousarray(ids, dtype=np.int64))


def load_inputs(source: str, *, trained_on: str,
                columns: jobspec.Data | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Inputs to predict on, preprocessed as training preprocessed `trained_on`, and their
    labels when the source has them (an npz may hold x alone). A file source is read whole,
    with the columns (label, features, object store) of `columns`, the trained job's data."""
    if files.is_file_set(source):
        spec = dataclasses.replace(columns or jobspec.Data(source=source), source=source, test=None)
        file_set = files.FileSet(spec, whole=True)
        x, y, _ = file_set.read_all(file_set.train_units)
        return _as_features(trained_on, x), y
    scheme, _, rest = source.partition(":")
    x, y, _ = _npz(rest, labels=False) if scheme == "npz" and rest else _raw(source)
    return _as_features(trained_on, x), None if y is None else np.ascontiguousarray(y, dtype=np.int64)


def preprocess(source: str, x: np.ndarray) -> np.ndarray:
    """What training does to a source's raw features: builtin:digits' pixel intensities
    (0..16) are scaled to 0..1; every other source is used as it is."""
    return x / np.float32(DIGITS_MAX) if source == DIGITS else x


def _as_features(source: str, x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(preprocess(source, np.asarray(x, dtype=np.float32)), dtype=np.float32)


def _raw(source: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    scheme, _, rest = source.partition(":")
    loaders = {"builtin": _builtin, "synthetic": _synthetic, "npz": _npz, "synthetic-ctr": _synthetic_ctr}
    if scheme not in loaders or not rest:
        raise errors.ConfigError(f"spec.data.source: unknown data source {source!r}")
    x, y, *ids = loaders[scheme](rest)
    return x, y, (ids[0] if ids else None)


def _builtin(name: str) -> tuple[np.ndarray, np.ndarray]:
    if name not in contract.BUILTIN_DATASETS:
        raise errors.ConfigError(f"spec.data.source: unknown built-in data set {name!r} (known: digits)")
    path = os.path.join(os.path.dirname(__file__), "datasets", f"{name}.csv.gz")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return table[:, :-1], table[:, -1].astype(np.int64)


def _synthetic(text: str) -> tuple[np.ndarray, np.ndarray]:
    p, problems = contract.synthetic_params(text)
    if problems:
        raise errors.ConfigError(f"spec.data.source: {'; '.join(problems)}")
    rng = np.random.default_rng(p["seed"])
    x = rng.standard_normal((p["samples"], p["features"]), dtype=np.float32)
    teacher = rng.standard_normal((p["features"], p["classes"]), dtype=np.float32)
    return x, np.argmax(x @ teacher, axis=1)


def _synthetic_ctr(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids, y, _ = synthetic_ctr(text)
    return np.zeros((len(y), 0), np.float32), y, ids


def synthetic_ctr(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A synthetic-ctr: source body's ids, labels, and the planted model's logit of each
    example (what the best possible model would score: the benchmarks' reference)."""
    p, problems = contract.ctr_params(text)
    if problems:
        raise errors.ConfigError(f"spec.data.source: {'; '.join(problems)}")
    fields, n, samples, seed = int(p["fields"]), int(p["ids"]), int(p["samples"]), int(p["seed"])
    rng = np.random.default_rng(seed)
    ids = _zipf_ranks(rng.random((samples, fields)), n, p["zipf"])
    # The planted model: a weight per (field, id), uniform with a logit spread of about 2.
    salted = ids + (np.arange(fields, dtype=np.int64) << 48)[None, :]
    unit = (rowkeys.mix(salted ^ seed) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    weights = (unit * 2 - 1) * 2.0 * np.sqrt(3.0 / fields)
    if p["missing"] > 0:
        # A stream of its own, so that the ids present and the label draws are those of the
        # same source without missing ids; a missing id adds nothing to the planted logit.
        gone = np.random.default_rng([seed, MISSING_STREAM]).random((samples, fields)) < p["missing"]
        ids[gone], weights[gone] = -1, 0.0
    logits = weights.sum(axis=1)
    y = (rng.random(samples) < 1 / (1 + np.exp(-logits))).astype(np.int64)
    return ids, y, logits


def _zipf_ranks(u: np.ndarray, n: int, a: float) -> np.ndarray:
    """Ranks 0..n-1 with P(rank k) about proportional to (k+1)**-a: the inverse CDF of a
    power law bounded to [1, n+1), for any n without a table of n probabilities."""
    if abs(a - 1.0) < 1e-9:
        ranks = np.exp(u * np.log(n + 1.0))
    else:
        ranks = (1 + u * ((n + 1.0) ** (1 - a) - 1)) ** (1 / (1 - a))
    return np.minimum(ranks.astype(np.int64) - 1, n - 1)


def _npz(path: str, labels: bool = True) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """x, y and ids of an npz file, checked; y may be absent when labels are not required,
    and x when ids are there (the dense features are then none)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            ids = archive["ids"] if "ids" in archive.files else None
            x = archive["x"] if "x" in archive.files or ids is None else np.zeros((len(ids), 0), np.float32)
            y = archive["y"] if labels or "y" in archive.files else None
    except (OSError, KeyError, ValueError) as exc:
        raise errors.ConfigError(f"spec.data.source: cannot read npz:{path}: {exc}") from exc
    if ids is not None and (ids.ndim != 2 or len(ids) != len(x) or not np.issubdtype(ids.dtype, np.integer)
                            or ids.size and (ids.min() < -1 or ids.max() >= MAX_ID)):
        raise errors.ConfigError(f"npz:{path}: ids must be integers of shape (n, fields), each -1 (missing) "
                                 f"or within 0..2**56-1")
    if x.ndim != 2 or (y is not None and (y.ndim != 1 or len(x) != len(y))):
        raise errors.ConfigError(f"npz:{path}: needs x of shape (n, features) and y of shape (n,), got "
                                 f"{x.shape} and {None if y is None else y.shape}")
    if len(x) == 0:
        raise errors.ConfigError(f"npz:{path}: holds no examples")
    _check_features(path, x)
    if y is not None:
        _check_labels(path, y, every_class=labels)
    return x, y, ids


def _check_features(path: str, x: np.ndarray) -> None:
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise errors.ConfigError(f"npz:{path}: x must hold numbers, got dtype {x.dtype}")
    finite = np.isfinite(x.astype(np.float32, copy=False))
    if not finite.all():
        row = int(np.argwhere(~finite)[0][0])
        raise errors.ConfigError(f"npz:{path}: x holds {int(finite.size - finite.sum())} non-finite values "
                                 f"(NaN or infinity), the first in row {row}")


def _check_labels(path: str, y: np.ndarray, *, every_class: bool = True) -> None:
    """Labels 0..C-1, and for training every class present: {0, 1, 7} is a mistake, not 8 classes."""
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise errors.ConfigError(f"npz:{path}: y must hold non-negative integer class labels")
    if not every_class:
        return
    present = np.unique(y)
    if len(present) < 2:
        raise errors.ConfigError(f"npz:{path}: y holds a single class ({int(present[0])}); training needs two or more")
    missing = np.setdiff1d(np.arange(int(present[-1]) + 1), present)
    if len(missing):
        raise errors.ConfigError(f"npz:{path}: y's labels must be 0..C-1 with every class present; labels "
                                 f"{{{_some(present)}}} leave out {_some(missing)}")


def _some(values: np.ndarray, shown: int = 10) -> str:
    return ", ".join(str(int(v)) for v in values[:shown]) + (", ..." if len(values) > shown else "")


def split(x: np.ndarray, y: np.ndarray, *, test_fraction: float, seed: int,
          ids: np.ndarray | None = None) -> Dataset:
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = max(1, int(round(len(x) * test_fraction)))
    if n_test >= len(x):
        raise errors.ConfigError(f"spec.data.testFraction: holding out {n_test} of {len(x)} examples "
                                 "leaves none to train on")
    test, train = order[:n_test], order[n_test:]
    return Dataset(x_train=x[train], y_train=y[train], x_test=x[test], y_test=y[test],
                   n_classes=int(y.max()) + 1, ids_train=None if ids is None else ids[train],
                   ids_test=None if ids is None else ids[test])


def minibatches(dataset: Dataset, batch_size: int, rng: np.random.Generator, *,
                with_ids: bool = False) -> Iterator[tuple[np.ndarray, ...]]:
    """An endless stream of (x, y) minibatches: shuffled epochs over the training part;
    with_ids, (x, y, ids) minibatches (a model with embeddings)."""
    for idx in batch_indices(len(dataset.x_train), batch_size, rng):
        if with_ids:
            yield dataset.x_train[idx], dataset.y_train[idx], dataset.ids_train[idx]
        else:
            yield dataset.x_train[idx], dataset.y_train[idx]


def batch_indices(n: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Which training examples each minibatch takes: shuffled epochs over 0..n-1."""
    batch_size = min(batch_size, n)
    while True:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start:start + batch_size]
