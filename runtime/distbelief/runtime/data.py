"""Data sources, the deterministic train/held-out split, and per-replica minibatch streams.

Sources (spec.data.source):
    builtin:digits                      8x8 handwritten digits, 1,797 examples, 10 classes
                                        (the copy bundled with scikit-learn, read as a file)
    synthetic:features=F,classes=C,samples=N[,seed=S]
                                        Gaussian inputs labelled by a fixed random linear
                                        teacher: learnable, any size, no download
    synthetic-ctr:fields=F,ids=N,samples=S[,zipf=A][,seed=K]
                                        click-style data: per field an id in 0..N-1 drawn
                                        Zipf(A) (rank 0 the most common), labels 0/1 drawn
                                        from a planted logistic model over per-id weights
    npz:/path/file.npz                  y (n,) integer labels, with x (n, features) and/or
                                        ids (n, fields) int64 categorical ids, -1 = missing

Every role that loads a source gets the same arrays and the same split (by the spec's
seed); each replica then draws its own random minibatches from the training part, so
replicas joining or leaving never bias what the model sees.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import os
from typing import Any, Iterator, Mapping

import numpy as np

from distbelief.runtime import contract, errors, rowtable

MAX_ID = 1 << 56  # ids share a 63-bit key with their field's number (embedding.keys)


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


def load(data_spec: Mapping[str, Any]) -> Dataset:
    """The split data set a job's spec.data describes."""
    x, y, ids = read_source(data_spec["source"])
    return split(x, y, ids=ids, test_fraction=float(data_spec.get("testFraction", 0.2)),
                 seed=int(data_spec.get("seed", 0)))


def load_source(source: str) -> tuple[np.ndarray, np.ndarray]:
    """A source's dense features and labels."""
    x, y, _ = read_source(source)
    return x, y


def read_source(source: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A source's dense features (possibly 0 columns), labels, and ids if it has them."""
    scheme, _, rest = source.partition(":")
    loaders = {"builtin": _builtin, "synthetic": _synthetic, "npz": _npz, "synthetic-ctr": _synthetic_ctr}
    if scheme not in loaders or not rest:
        raise errors.ConfigError(f"spec.data.source: unknown data source {source!r}")
    x, y, *ids = loaders[scheme](rest)
    return (np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(y, dtype=np.int64),
            np.ascontiguousarray(ids[0], dtype=np.int64) if ids and ids[0] is not None else None)


def _builtin(name: str) -> tuple[np.ndarray, np.ndarray]:
    if name != "digits":
        raise errors.ConfigError(f"spec.data.source: unknown built-in data set {name!r} (known: digits)")
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise errors.ConfigError("builtin:digits needs scikit-learn's bundled data (pip install scikit-learn)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return table[:, :-1] / 16.0, table[:, -1].astype(np.int64)


def _synthetic(text: str) -> tuple[np.ndarray, np.ndarray]:
    p, problems = contract.synthetic_params(text)
    if problems:
        raise errors.ConfigError(f"spec.data.source: {'; '.join(problems)}")
    rng = np.random.default_rng(p["seed"])
    x = rng.standard_normal((p["samples"], p["features"]), dtype=np.float32)
    teacher = rng.standard_normal((p["features"], p["classes"]), dtype=np.float32)
    return x, np.argmax(x @ teacher, axis=1)


def _synthetic_ctr(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p, problems = contract.ctr_params(text)
    if problems:
        raise errors.ConfigError(f"spec.data.source: {'; '.join(problems)}")
    fields, n, samples, seed = int(p["fields"]), int(p["ids"]), int(p["samples"]), int(p["seed"])
    rng = np.random.default_rng(seed)
    ids = _zipf_ranks(rng.random((samples, fields)), n, p["zipf"])
    # The planted model: a weight per (field, id), uniform with a logit spread of about 2.
    salted = ids + (np.arange(fields, dtype=np.int64) << 48)[None, :]
    unit = (rowtable.mix(salted ^ seed) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    logits = ((unit * 2 - 1) * 2.0 * np.sqrt(3.0 / fields)).sum(axis=1)
    y = (rng.random(samples) < 1 / (1 + np.exp(-logits))).astype(np.int64)
    return np.zeros((samples, 0), np.float32), y, ids


def _zipf_ranks(u: np.ndarray, n: int, a: float) -> np.ndarray:
    """Ranks 0..n-1 with P(rank k) about proportional to (k+1)**-a: the inverse CDF of a
    power law bounded to [1, n+1), for any n without a table of n probabilities."""
    if abs(a - 1.0) < 1e-9:
        ranks = np.exp(u * np.log(n + 1.0))
    else:
        ranks = (1 + u * ((n + 1.0) ** (1 - a) - 1)) ** (1 / (1 - a))
    return np.minimum(ranks.astype(np.int64) - 1, n - 1)


def _npz(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            ids = archive["ids"] if "ids" in archive.files else None
            x = archive["x"] if "x" in archive.files or ids is None else np.zeros((len(ids), 0), np.float32)
            y = archive["y"]
    except (OSError, KeyError, ValueError) as exc:
        raise errors.ConfigError(f"spec.data.source: cannot read npz:{path}: {exc}") from exc
    if ids is not None and (ids.ndim != 2 or len(ids) != len(y) or not np.issubdtype(ids.dtype, np.integer)
                            or ids.size and (ids.min() < -1 or ids.max() >= MAX_ID)):
        raise errors.ConfigError(f"npz:{path}: ids must be integers of shape (n, fields), each -1 (missing) "
                                 f"or within 0..2**56-1")
    if x.ndim != 2 or y.ndim != 1 or len(x) != len(y):
        raise errors.ConfigError(
            f"npz:{path}: needs x of shape (n, features) and y of shape (n,), got {x.shape} and {y.shape}")
    if len(y) == 0:
        raise errors.ConfigError(f"npz:{path}: holds no examples")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise errors.ConfigError(f"npz:{path}: y must hold non-negative integer class labels")
    return x, y, ids


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


def minibatches(dataset: Dataset, batch_size: int, rng: np.random.Generator) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """An endless stream of minibatches: shuffled epochs over the training part."""
    for idx in batch_indices(len(dataset.x_train), batch_size, rng):
        yield dataset.x_train[idx], dataset.y_train[idx]


def batch_indices(n: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Which training examples each minibatch takes: shuffled epochs over 0..n-1."""
    batch_size = min(batch_size, n)
    while True:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start:start + batch_size]
