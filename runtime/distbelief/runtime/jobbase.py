"""The hand-written half of the typed job: what jobspec/'s generated classes derive from
their fields, and how its resolver reads one value of a spec.

tools/gen-jobspec writes jobspec/ from the CRD: a frozen dataclass per object of the
spec, and `resolve(spec)`. A class `<Name>Base` here is the base of the generated class
`<Name>`: its properties are values the CRD does not hold but every reader would otherwise
work out again (the shards' copies, a duration in seconds, the memory limit). Each base
declares the fields it reads; the generated class holds them.

`Section` and the readers below are what the generated resolver calls: each checks one
value's type and names the field when it is wrong, so that a config the roles cannot
read says where.

Like contract.py, this module imports only the standard library.
"""

from __future__ import annotations

import copy
import dataclasses
from decimal import Decimal
from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")
Read = Callable[[Any, str], T]   # (value, its path) -> the typed value; ValueError names the path


class ModelBase:
    type: str | None
    entrypoint: str | None

    @property
    def builtin(self) -> str | None:
        """The built-in model the replicas train (spec.model.type; an mlp when unset), None
        for user code (spec.model.entrypoint)."""
        return None if self.entrypoint else self.type or "mlp"


class DataBase:
    source: str

    @property
    def is_file_set(self) -> bool:
        """Many files read by column: parquet:, csv:, npy:, npz: with a glob, or s3:// (model/files.py)."""
        scheme, _, path = self.source.partition(":")
        return (scheme in ("parquet", "csv", "npy", "s3") or
                (scheme == "npz" and any(c in path for c in "*?[")))


class TrainingBase:
    algorithm: str
    max_duration: str | None

    @property
    def max_duration_seconds(self) -> float | None:
        """spec.training.maxDuration in seconds; None: no limit."""
        return None if self.max_duration is None else parse_duration(self.max_duration)


class ParameterServersBase:
    backups: int
    resources: Mapping[str, Any]

    @property
    def copies(self) -> int:
        """Copies of each shard: the primary and its backups."""
        return 1 + self.backups

    @property
    def memory_limit(self) -> str | None:
        """The shards' resources.limits.memory, a quantity ("2Gi"), from which a shard derives
        its row budget; None: no limit."""
        memory = (self.resources.get("limits") or {}).get("memory")
        return None if memory is None else str(memory)


class JobSpecBase:
    data: DataBase
    training: TrainingBase

    @property
    def streams_data(self) -> bool:
        """The replicas stream the units the chief hands them (algorithms/feed/), rather than
        each loading the data set: a file source under Downpour, with or without embeddings
        (a partitioned replica's partition 0 streams; Sandblaster loads it whole)."""
        return self.data.is_file_set and self.training.algorithm == "downpour"


def as_spec(typed: Any) -> dict[str, Any]:
    """A generated class's values as a spec's mapping: camelCase keys, lists, every default
    applied, unset fields left out (user code gets spec.model so: models.py)."""
    return {_camel(field.name): _plain(value) for field in dataclasses.fields(typed)
            if (value := getattr(typed, field.name)) is not None}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return as_spec(value)
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return copy.deepcopy(value)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


# ------------------------------------------------------------ the resolver's readers


class Section:
    """One mapping of the spec and its path, read key by key: a missing key takes its
    default (a config from before the field existed); a missing required key, or a value
    of the wrong type, is a ValueError naming the field."""

    def __init__(self, values: Any, path: str) -> None:
        if not isinstance(values, Mapping):
            raise ValueError(f"{path}: must be a mapping (got {values!r})")
        self.values, self.path = values, path

    def required(self, key: str, read: Read[T]) -> T:
        value = self.values.get(key)
        if value is None:
            raise ValueError(f"{self.path}.{key}: required")
        return read(value, f"{self.path}.{key}")

    def get(self, key: str, read: Read[T], default: T) -> T:
        value = self.values.get(key)
        return default if value is None else read(value, f"{self.path}.{key}")

    def optional(self, key: str, read: Read[T]) -> T | None:
        value = self.values.get(key)
        return None if value is None else read(value, f"{self.path}.{key}")


def integer(value: Any, path: str) -> int:
    number(value, path)  # refuses what is no number at all
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{path}: must be an integer (got {value!r})")
    return int(value)


def number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}: must be a number (got {value!r})")
    return float(value)


def boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{path}: must be a boolean (got {value!r})")
    return value


def string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{path}: must be a string (got {value!r})")
    return value


def duration(value: Any, path: str) -> str:
    """A duration as written ("90s", "1h30m"), checked: TrainingBase gives its seconds."""
    try:
        parse_duration(string(value, path))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return value


def integers(value: Any, path: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{path}: must be a list of integers (got {value!r})")
    return tuple(value)


def strings(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{path}: must be a list of strings (got {value!r})")
    return tuple(value)


def mapping(value: Any, path: str) -> Mapping[str, Any]:
    """A free-form Kubernetes object (a pod template, resources), as a copy of its own."""
    return copy.deepcopy(dict(Section(value, path).values))


def mappings(value: Any, path: str) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(value, list):
        raise ValueError(f"{path}: must be a list (got {value!r})")
    return tuple(mapping(item, f"{path}[{i}]") for i, item in enumerate(value))


# ------------------------------------------------------- quantities and durations


_QUANTITY_SUFFIXES = {"m": Decimal("0.001"), **{p: Decimal(10) ** (3 * i) for i, p in enumerate("kMGTPE", 1)},
                      **{p + "i": Decimal(2) ** (10 * i) for i, p in enumerate("KMGTPE", 1)}}


def quantity(text: str | int | float) -> Decimal:
    """A Kubernetes quantity ("500m", "2", "1.5" CPUs; "1Gi", "512M", "1e9" bytes) as a number."""
    text = str(text)
    for suffix in sorted(_QUANTITY_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix):
            return Decimal(text[: -len(suffix)]) * _QUANTITY_SUFFIXES[suffix]
    return Decimal(text)


def parse_duration(text: str) -> float:
    """Seconds in a Go-style duration such as '90s', '1h30m' or '250ms'."""
    if not isinstance(text, str):
        raise ValueError(f"not a duration: {text!r}")
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    total, digits = 0.0, ""
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isdigit() or ch == ".":
            digits += ch
            i += 1
            continue
        unit = "ms" if text.startswith("ms", i) else ch
        if unit not in units or not digits:
            raise ValueError(f"not a duration: {text!r}")
        total += float(digits) * units[unit]
        digits = ""
        i += len(unit)
    if digits:
        raise ValueError(f"not a duration (missing unit): {text!r}")
    if not text:
        raise ValueError("not a duration: empty")
    return total
