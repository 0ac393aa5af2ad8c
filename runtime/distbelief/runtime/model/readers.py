"""Readers of one file format each: a file's columns, its work units, a unit's columns as
arrays. pyarrow is imported only by a job that reads Parquet or CSV.

A reader opens files through `opener` (path -> a binary file object), local files by
default; an object store's (objectstore.py) otherwise. What a file's library raises on a
missing, unreadable or corrupt file becomes one errors.BadData naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from distbelief.runtime import errors

Opener = Callable[[str], Any]   # path -> a readable binary file object


@dataclasses.dataclass(frozen=True)
class Unit:
    """One work unit: a file, or a row group of a Parquet file (group -1: the whole file)."""

    file: str
    group: int = -1
    rows: int = 0

    def where(self) -> str:
        return self.file if self.group < 0 else f"{self.file} row group {self.group}"


@contextlib.contextmanager
def reading(where: str) -> Iterator[None]:
    """Turn what reading a file raises into BadData naming the file."""
    try:
        yield
    except errors.BadData:
        raise
    except FileNotFoundError as exc:
        raise errors.BadData(where, "no such file") from exc
    except Exception as exc:  # pyarrow's, numpy's, zipfile's and the object store's errors alike
        raise errors.BadData(where, f"cannot be read: {type(exc).__name__}: {exc}") from exc


def _local(path: str) -> Any:
    return open(path, "rb")


class ParquetReader:
    """One unit per row group; the label's maximum from the row groups' statistics."""

    def __init__(self, opener: Opener | None = None) -> None:
        import pyarrow.parquet  # noqa: F401  (data plane: only a Parquet job needs it)
        self.open = opener or _local
        self._meta: dict[str, Any] = {}

    def _file(self, path: str) -> Any:
        import pyarrow.parquet as pq
        with reading(path):
            return pq.ParquetFile(self.open(path))

    def _schema(self, path: str) -> Any:
        if path not in self._meta:
            with reading(path):
                self._meta[path] = self._file(path).schema_arrow
        return self._meta[path]

    def columns(self, path: str) -> list[str]:
        return list(self._schema(path).names)

    def numeric(self, path: str) -> list[str]:
        import pyarrow.types as pt
        return [f.name for f in self._schema(path) if pt.is_integer(f.type) or pt.is_floating(f.type)
                or pt.is_boolean(f.type)]

    def width(self, path: str, names: Sequence[str]) -> int:
        return len(names)

    def units(self, path: str) -> list[Unit]:
        with reading(path):
            meta = self._file(path).metadata
            return [Unit(path, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]

    def label_max(self, unit: Unit, label: str) -> int:
        with reading(unit.where()):
            group = self._file(unit.file).metadata.row_group(unit.group)
            stats = group.column(self.columns(unit.file).index(label)).statistics
            if stats is not None and stats.has_min_max and isinstance(stats.max, int):
                return int(stats.max)
        return _max_label(unit, self.read(unit, _only(label))[label])

    def read(self, unit: Unit, columns: Any) -> dict[str, np.ndarray]:
        with reading(unit.where()):
            table = self._file(unit.file).read_row_group(unit.group, columns=_names(columns))
            return {name: table.column(name).to_numpy() for name in table.column_names}


class CsvReader:
    """One unit per file; a header row names the columns (.gz files are gunzipped)."""

    def __init__(self, opener: Opener | None = None) -> None:
        import pyarrow.csv  # noqa: F401
        self.open = opener or _local
        self._schemas: dict[str, Any] = {}

    def _stream(self, path: str) -> Any:
        import pyarrow as pa
        raw = self.open(path)
        return pa.CompressedInputStream(raw, "gzip") if path.endswith(".gz") else raw

    def _schema(self, path: str) -> Any:
        import pyarrow.csv as csv
        if path not in self._schemas:
            with reading(path):
                self._schemas[path] = csv.open_csv(self._stream(path)).schema
        return self._schemas[path]

    def columns(self, path: str) -> list[str]:
        return list(self._schema(path).names)

    def numeric(self, path: str) -> list[str]:
        import pyarrow.types as pt
        return [f.name for f in self._schema(path) if pt.is_integer(f.type) or pt.is_floating(f.type)]

    def width(self, path: str, names: Sequence[str]) -> int:
        return len(names)

    def units(self, path: str) -> list[Unit]:
        return [Unit(path)]

    def label_max(self, unit: Unit, label: str) -> int:
        return _max_label(unit, self.read(unit, _only(label))[label])

    def read(self, unit: Unit, columns: Any) -> dict[str, np.ndarray]:
        import pyarrow.csv as csv
        with reading(unit.where()):
            table = csv.read_csv(self._stream(unit.file),
                                 convert_options=csv.ConvertOptions(include_columns=_names(columns)))
            return {name: table.column(name).to_numpy() for name in table.column_names}


class NpzReader:
    """One unit per file; every array a column, a 2-D array a block of columns."""

    def __init__(self, opener: Opener | None = None) -> None:
        self.open = opener or _local

    def _arrays(self, path: str, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        with reading(path), self.open(path) as f, np.load(f, allow_pickle=False) as archive:
            return {name: archive[name] for name in (names or archive.files)}

    def columns(self, path: str) -> list[str]:
        with reading(path), self.open(path) as f, np.load(f, allow_pickle=False) as archive:
            return list(archive.files)   # the zip's directory only: no array is read

    def numeric(self, path: str) -> list[str]:
        return [n for n, a in self._arrays(path).items() if np.issubdtype(a.dtype, np.number)]

    def width(self, path: str, names: Sequence[str]) -> int:
        arrays = self._arrays(path, names)
        return sum(int(np.prod(arrays[n].shape[1:], dtype=np.int64)) for n in names)

    def units(self, path: str) -> list[Unit]:
        return [Unit(path)]

    def label_max(self, unit: Unit, label: str) -> int:
        return _max_label(unit, self._arrays(unit.file, [label])[label])

    def read(self, unit: Unit, columns: Any) -> dict[str, np.ndarray]:
        arrays = self._arrays(unit.file, _names(columns))
        lengths = {len(a) for a in arrays.values()}
        if len(lengths) > 1:
            raise errors.BadData(unit.where(), f"its arrays differ in length ({sorted(lengths)})")
        return arrays


class NpyReader(NpzReader):
    """One unit per file: a structured array, every field a column."""

    def _arrays(self, path: str, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        with reading(path):
            with self.open(path) as f:
                table = np.load(f, allow_pickle=False)
            if table.dtype.names is None:
                raise ValueError("not a structured array (np.save an array with named fields)")
            return {name: np.ascontiguousarray(table[name]) for name in (names or table.dtype.names)}

    def columns(self, path: str) -> list[str]:
        return list(self._arrays(path))


def _names(columns: Any) -> list[str]:
    return list(dict.fromkeys([*columns.features, columns.label, *columns.ids]))


@dataclasses.dataclass(frozen=True)
class _only:
    label: str
    features: tuple = ()
    ids: tuple = ()


def _max_label(unit: Unit, values: np.ndarray) -> int:
    if values.size == 0:
        return -1
    if not np.issubdtype(values.dtype, np.number):
        raise errors.BadData(unit.where(), f"the label column holds {values.dtype}, not class numbers")
    return int(np.nanmax(values))


READERS: dict[str, Callable[[Opener | None], Any]] = {
    "parquet": ParquetReader, "csv": CsvReader, "npz": NpzReader, "npy": NpyReader}
