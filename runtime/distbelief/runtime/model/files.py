"""Sources of many files: Parquet, CSV (optionally gzipped), npz and npy, by glob.

    parquet:/data/train/*.parquet      read row group by row group (pyarrow)
    csv:/data/train/*.csv[.gz]         a header row names the columns
    npz:/data/train/*.npz              every array a column (a 2-D array: a block of columns)
    npy:/data/train/*.npy              a structured array: every field a column
    s3://bucket/prefix/*.parquet       any of these in an object store (objectstore.py)

A file set is read in work units: one per Parquet row group, one per file otherwise. The
label is the column spec.data.label (default y); the features are spec.data.features or
else every other numeric column (not an id column); spec.data.ids name integer id columns
for embeddings. Every file must have the first file's columns. The held-out files are
spec.data.test's, or else whole files drawn by the split's seed (testFraction of them).

Every problem is a ConfigError naming the file, and the column and row group where there
is one (errors.BadData), so that spec.data.onBadFile can skip the file instead.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import math
from typing import Callable, Sequence

import numpy as np

from distbelief.runtime import errors, jobspec
from distbelief.runtime.model import objectstore
from distbelief.runtime.model.readers import READERS, Unit

FILE_SCHEMES = ("parquet", "csv", "npz", "npy")
GLOB_CHARS = "*?["
log = logging.getLogger(__name__)

MAX_ID = 1 << 56  # as data.MAX_ID: ids share a 63-bit key with their field's number


def is_file_set(source: str) -> bool:
    """A source this module reads: parquet:, csv:, npy:, or npz: with a glob."""
    return jobspec.Data(source=source).is_file_set


@dataclasses.dataclass(frozen=True)
class Columns:
    label: str
    features: tuple[str, ...]
    ids: tuple[str, ...]


Part = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]   # x float32, y int64, ids int64 | None


class FileSet:
    """A file source's training and held-out units, its columns and its classes."""

    def __init__(self, spec: jobspec.Data, *, whole: bool = False) -> None:
        """whole: every file is read as training files, none held out (inputs to predict on)."""
        self.spec = spec
        expand: Callable[[str], list[str]]
        if spec.source.startswith(objectstore.PREFIX):
            bucket = objectstore.Bucket(spec.object_store)
            self.scheme, pattern, opener, expand = objectstore.format_of(spec.source), spec.source, bucket.open, bucket.glob
        else:
            self.scheme, _, pattern = spec.source.partition(":")
            opener, expand = None, _local_glob
        self.reader = READERS[self.scheme](opener)
        files = _expand(pattern, expand)
        if whole:
            self.train_files, self.test_files = files, []
        elif spec.test:
            test = spec.test if spec.test.startswith(objectstore.PREFIX) or ":" not in spec.test else spec.test.partition(":")[2]
            self.test_files = _expand(test, expand)
            self.train_files = [f for f in files if f not in set(self.test_files)]
        else:
            self.train_files, self.test_files = _hold_out(files, spec.test_fraction, spec.seed)
        if not self.train_files:
            raise errors.ConfigError(f"spec.data.source: {spec.source} leaves no file to train on "
                                     "(all are held out by spec.data.test)")
        self.skip_bad = spec.on_bad_file == "skip"
        self.skipped: list[str] = []                # what onBadFile: skip left out, and why
        first = self._first_readable()
        names = self.reader.columns(first)
        self.columns = _choose(spec, names, first, self.reader.numeric(first))
        self.n_features = self.reader.width(first, self.columns.features)
        self.fields = self.reader.width(first, self.columns.ids)
        self.train_units = self._units(self.train_files, first, names)
        self.test_units = self._units(self.test_files, first, names)
        self.n_classes = self._classes()

    def _first_readable(self) -> str:
        """The first training file, or with onBadFile: skip the first that can be read."""
        for path in self.train_files:
            try:
                self.reader.columns(path)
                return path
            except errors.BadData as exc:
                self._skip_or_raise(exc)
        raise errors.ConfigError(f"spec.data.source: no file of {self.spec.source} can be read "
                                 f"({'; '.join(self.skipped)})")

    def _skip_or_raise(self, exc: errors.BadData) -> None:
        if not self.skip_bad:
            raise exc
        log.warning("event=bad_file_skipped reason=%r", str(exc))
        self.skipped.append(str(exc))

    def _units(self, files: Sequence[str], first: str, names: Sequence[str]) -> list[Unit]:
        units = []
        for path in files:
            try:
                columns = list(self.reader.columns(path))
                if columns != list(names):
                    raise errors.BadData(path, f"its columns {columns} differ from {first}'s {list(names)}")
                units.extend(self.reader.units(path))
            except errors.BadData as exc:
                self._skip_or_raise(exc)
        return units

    def _classes(self) -> int:
        """Classes: the largest training label + 1 (Parquet: from the row groups' statistics)."""
        top, kept = -1, []
        for unit in self.train_units:
            try:
                top = max(top, self.reader.label_max(unit, self.columns.label))
                kept.append(unit)
            except errors.BadData as exc:
                self._skip_or_raise(exc)
        self.train_units = kept
        if not kept:
            raise errors.ConfigError(f"spec.data.source: no unit of {self.spec.source} is left to train on")
        if top < 1:
            raise errors.ConfigError(f"spec.data.label: column {self.columns.label!r} of {self.spec.source} "
                                     "holds a single class; training needs two or more")
        return top + 1

    def read(self, unit: Unit, *, n_classes: int | None = None) -> Part:
        """A unit's features, labels (checked: 0..classes-1) and ids (checked), as training uses them."""
        table = self.reader.read(unit, self.columns)
        return check(unit, self.columns, table, n_classes or self.n_classes)

    def read_all(self, units: Sequence[Unit], limit: int | None = None) -> Part:
        """Units read one after another into one set of arrays, at most `limit` examples
        (with onBadFile: skip, without the units that cannot be used)."""
        parts, total = [], 0
        for unit in units:
            try:
                parts.append(self.read(unit))
            except errors.BadData as exc:
                self._skip_or_raise(exc)
                continue
            total += len(parts[-1][1])
            if limit is not None and total >= limit:
                break
        if not parts:
            raise errors.ConfigError(f"spec.data.source: no usable examples in {len(units)} units of {self.spec.source}")
        x, y, ids = (np.concatenate([p[i] for p in parts]) if parts[0][i] is not None else None for i in range(3))
        return (x[:limit], y[:limit], None if ids is None else ids[:limit]) if limit else (x, y, ids)


def check(unit: Unit, columns: Columns, table: dict[str, np.ndarray], n_classes: int) -> Part:
    """The arrays of a unit's columns, checked: finite features, integer labels within the
    classes, ids within 0..2**56-1 or -1 (missing)."""
    label = table[columns.label]
    x = _features(unit, columns, table, len(label))
    if not np.issubdtype(label.dtype, np.integer) and not _whole(label):
        raise errors.BadData(unit.where(), f"column {columns.label!r} must hold integer class labels "
                             f"(got {label.dtype})")
    y = np.ascontiguousarray(label, dtype=np.int64)
    bad = (y < 0) | (y >= n_classes)
    if bad.any():
        row = int(np.argmax(bad))
        raise errors.BadData(unit.where(), f"column {columns.label!r} row {row}: label {int(y[row])} is outside "
                             f"the classes 0..{n_classes - 1}")
    finite = np.isfinite(x)
    if not finite.all():
        row, col = (int(v) for v in np.argwhere(~finite)[0])
        raise errors.BadData(unit.where(), f"column {_feature_name(columns, table, col)!r} row {row}: "
                             f"{x[row, col]} is not a finite number")
    return x, y, _ids(unit, columns, table, len(y))


def _features(unit: Unit, columns: Columns, table: dict[str, np.ndarray], n: int) -> np.ndarray:
    """The feature columns side by side as float32, each written straight into its place
    (no per-column copy: a row group of 784 columns is 784 arrays)."""
    blocks = [_numeric(unit, name, table[name]).reshape(n, -1) for name in columns.features]
    x = np.empty((n, sum(b.shape[1] for b in blocks)), np.float32)
    start = 0
    for block in blocks:
        x[:, start:start + block.shape[1]] = block
        start += block.shape[1]
    return x


def _ids(unit: Unit, columns: Columns, table: dict[str, np.ndarray], n: int) -> np.ndarray | None:
    if not columns.ids:
        return None
    blocks = []
    for name in columns.ids:
        values = table[name]
        if not np.issubdtype(values.dtype, np.integer) or values.size and (values.min() < -1 or values.max() >= MAX_ID):
            raise errors.BadData(unit.where(), f"id column {name!r} must hold integers within 0..2**56-1 "
                                 "or -1 (missing)")
        blocks.append(values.astype(np.int64).reshape(n, -1))
    return np.ascontiguousarray(np.column_stack(blocks))


def _feature_name(columns: Columns, table: dict[str, np.ndarray], col: int) -> str:
    for name in columns.features:
        width = int(np.prod(table[name].shape[1:], dtype=np.int64))
        if col < width:
            return name
        col -= width
    return "?"


def _numeric(unit: Unit, name: str, values: np.ndarray) -> np.ndarray:
    if not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_):
        raise errors.BadData(unit.where(), f"feature column {name!r} must hold numbers (got {values.dtype})")
    return values


def _whole(values: np.ndarray) -> bool:
    return np.issubdtype(values.dtype, np.floating) and bool(np.all(np.isfinite(values) & (values == np.round(values))))


def _local_glob(pattern: str) -> list[str]:
    return sorted(glob.glob(pattern)) if any(c in pattern for c in GLOB_CHARS) else [pattern]


def _expand(pattern: str, expand: Callable[[str], list[str]]) -> list[str]:
    files = expand(pattern)
    if not files:
        raise errors.ConfigError(f"spec.data.source: no file matches {pattern}")
    return files


def _hold_out(files: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Whole files held out: testFraction of them (at least one), drawn by the seed."""
    if len(files) < 2:
        raise errors.ConfigError(f"spec.data.source: {files[0]} is a single file; holding out whole files "
                                 "needs two or more, or name the held-out files in spec.data.test")
    order = np.random.default_rng(seed).permutation(len(files))
    held = {int(i) for i in order[:max(1, min(len(files) - 1, math.floor(len(files) * fraction + 0.5)))]}
    return ([f for i, f in enumerate(files) if i not in held], [f for i, f in enumerate(files) if i in held])


def _choose(spec: jobspec.Data, names: Sequence[str], first: str, numeric: Sequence[str]) -> Columns:
    """The label, feature and id columns, each checked to exist in the first file."""
    for field, wanted in (("label", [spec.label]), ("features", spec.features or ()), ("ids", spec.ids)):
        missing = [n for n in wanted if n not in names]
        if missing:
            raise errors.ConfigError(f"spec.data.{field}: {first} has no column {missing[0]!r} "
                                     f"(its columns: {', '.join(names)})")
    features = tuple(spec.features) if spec.features is not None else tuple(
        n for n in numeric if n != spec.label and n not in spec.ids)
    if not features and not spec.ids:
        raise errors.ConfigError(f"spec.data.features: {first} has no numeric column besides the label "
                                 f"{spec.label!r}")
    return Columns(label=spec.label, features=features, ids=tuple(spec.ids))
