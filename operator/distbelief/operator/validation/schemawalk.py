"""The schema walker: checks a value against a CRD's structural schema and applies its
defaults, the way the API server does, collecting one ``path: rule`` line per problem.

Where a rule alone would not tell a user what to write, the line says more: a pattern
is explained with an example of a valid value, and a number that YAML 1.1 read as a
string (``1e9``) gets a hint.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import functools
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")
_SHOW_MAX = 60

# The CRD's patterns in words, each with examples of valid values; any other pattern is
# shown as it is.
PATTERN_RULES = {
    r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$":
        "must be module:function, for example my_models.mlp:build",
    r"^((builtin|synthetic|synthetic-ctr|npz|npy|parquet|csv):.+|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/.+[.](parquet|csv|csv[.]gz|npz|npy))$":
        "must be a data source: builtin:digits, synthetic:features=20,classes=4,samples=5000, "
        "synthetic-ctr:fields=8,ids=20000,samples=60000, npz:/data/train.npz or files by glob such as "
        "parquet:/data/train/*.parquet, csv:/data/train/*.csv.gz or s3://bucket/train/*.parquet",
    r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$":
        "must be a duration: a number with a unit ms, s, m or h, for example 90s, 30m, 2h or 1h30m",
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$":
        "must be a Kubernetes quantity, for example 500m or 2 (CPUs), 256Mi or 1Gi (bytes)",
    r"^([0-9]+(\.[0-9]*)?)([KMGTPE]i|[kMGTPE])?$":
        "must be a size, for example 1Gi, 500Mi or 10G",
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$":
        "must be a PersistentVolumeClaim name: lowercase letters, digits, '-' and '.', for example training-data",
    r"^https?://[^/\s]+/?$":
        "must be an object store's URL: http:// or https://, a host and an optional port, for example "
        "http://minio.storage:9000",
    r"^[a-z0-9-]+$":
        "must be a region: lowercase letters, digits and '-', for example us-east-1",
    r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$":
        "must be a Secret name: lowercase letters, digits, '-' and '.', for example training-data-s3",
}
# YAML 1.1 (PyYAML, kubectl) reads 1e9 as a string: its floats need a dot (1.0e9).
_NUMBER_LIKE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\Z")


def _pattern_rule(pattern: str) -> str:
    return PATTERN_RULES.get(pattern, f"must match {pattern}")


def _number_hint(value: Any, wanted: str) -> str:
    if wanted not in ("number", "integer") or not isinstance(value, str) or not _NUMBER_LIKE.match(value.strip()):
        return ""
    number = float(value)
    plain = str(int(number)) if number.is_integer() else f"{number:.15g}"
    return f"; YAML 1.1 reads {value} as text: write {number:.1e} or {plain}, unquoted"


class Problems:
    """Collects ``path: rule`` lines and remembers which paths already failed."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._paths: list[str] = []

    def add(self, path: str, rule: str) -> None:
        self._paths.append(path)
        self.lines.append(f"{path or '(root)'}: {rule}")

    def at(self, path: str) -> bool:
        """Whether a problem was already reported at ``path`` or below it."""
        return any(p == path or p.startswith((path + ".", path + "[")) for p in self._paths)


def join(path: str, key: str) -> str:
    if _PLAIN_KEY.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


def kind(value: Any) -> str:
    if value is None:
        return "null"
    for py, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                     (list, "array"), (dict, "object")):
        if isinstance(value, py):
            return name
    return type(value).__name__


def show(value: Any) -> str:
    """A value as one short line of JSON."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _SHOW_MAX else text[: _SHOW_MAX - 3] + "..."


def got(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return f"got {kind(value)}"
    return f"got {kind(value)} {show(value)}"


# -------------------------------------------------------------- the schema walker


class Walker:
    """Applies defaults and checks one structural schema, the way the API server does. An
    unknown field is a problem, or with prune (the API server's own pruning) dropped and
    named in `pruned`."""

    def __init__(self, problems: Problems, *, prune: bool = False) -> None:
        self.problems, self.prune = problems, prune
        self.pruned: list[str] = []

    def walk(self, value: Any, schema: Mapping[str, Any], path: str) -> Any:
        """The checked value (integral floats of integer fields become ints)."""
        if value is None and schema.get("nullable"):
            return value
        if not self._type_ok(value, schema, path) or not self._any_of_ok(value, schema, path):
            return value
        if isinstance(value, bool):
            pass
        elif isinstance(value, (int, float)):
            value = self._number(value, schema, path)
        elif isinstance(value, str):
            self._string(value, schema, path)
        elif isinstance(value, list):
            self._array(value, schema, path)
        elif isinstance(value, dict):
            self._object(value, schema, path)
        self._enum(value, schema, path)
        return value

    def _type_ok(self, value: Any, schema: Mapping[str, Any], path: str) -> bool:
        if schema.get("x-kubernetes-int-or-string"):
            if _is_integer(value) or isinstance(value, str):
                return True
            self.problems.add(path, f"must be an integer or a string ({got(value)})")
            return False
        wanted = schema.get("type")
        if wanted is None or _TYPE_CHECKS[wanted](value):
            return True
        self.problems.add(path, f"must be of type {wanted} ({got(value)}){_number_hint(value, wanted)}")
        return False

    def _any_of_ok(self, value: Any, schema: Mapping[str, Any], path: str) -> bool:
        branches = schema.get("anyOf")
        if not branches:
            return True
        for branch in branches:
            trial = Problems()
            Walker(trial, prune=self.prune).walk(copy.deepcopy(value), branch, path)
            if not trial.lines:
                return True
        self.problems.add(path, f"must match one of the anyOf schemas ({got(value)})")
        return False

    def _enum(self, value: Any, schema: Mapping[str, Any], path: str) -> None:
        allowed = schema.get("enum")
        if allowed is not None and value not in allowed:
            choices = ", ".join(map(str, allowed))
            self.problems.add(path, f"must be one of {choices} ({got(value)})")

    def _number(self, value: int | float, schema: Mapping[str, Any], path: str) -> int | float:
        if isinstance(value, float) and (
            schema.get("type") == "integer" or schema.get("x-kubernetes-int-or-string")
        ):
            value = int(value)
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None:
            if schema.get("exclusiveMinimum") and not value > low:
                self.problems.add(path, f"must be > {show(low)} (got {show(value)})")
            elif value < low:
                self.problems.add(path, f"must be >= {show(low)} (got {show(value)})")
        if high is not None:
            if schema.get("exclusiveMaximum") and not value < high:
                self.problems.add(path, f"must be < {show(high)} (got {show(value)})")
            elif value > high:
                self.problems.add(path, f"must be <= {show(high)} (got {show(value)})")
        return value

    def _string(self, value: str, schema: Mapping[str, Any], path: str) -> None:
        if "minLength" in schema and len(value) < schema["minLength"]:
            self.problems.add(path, f"must be at least {schema['minLength']} characters "
                                    f"(got {len(value)}: {show(value)})")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            self.problems.add(path, f"must be at most {schema['maxLength']} characters "
                                    f"(got {len(value)})")
        if "pattern" in schema and not regex(schema["pattern"]).search(value):
            self.problems.add(path, f"{_pattern_rule(schema['pattern'])} (got {show(value)})")
        if schema.get("format") == "date-time" and not _is_date_time(value):
            self.problems.add(path, f"must be an RFC 3339 date-time (got {show(value)})")

    def _array(self, value: list[Any], schema: Mapping[str, Any], path: str) -> None:
        count = len(value)
        if "minItems" in schema and count < schema["minItems"]:
            self.problems.add(path, f"must have at least {schema['minItems']} items (got {count})")
        if "maxItems" in schema and count > schema["maxItems"]:
            self.problems.add(path, f"must have at most {schema['maxItems']} items (got {count})")
        items = schema.get("items")
        if isinstance(items, Mapping):
            for i, item in enumerate(value):
                value[i] = self.walk(item, items, f"{path}[{i}]")

    def _unknown_field(self, value: dict[str, Any], key: str, where: str, props: Mapping[str, Any]) -> None:
        if self.prune:
            del value[key]
            self.pruned.append(where)
        else:
            self.problems.add(where, REPLACED.get(where) or _unknown(key, props))

    def _object(self, value: dict[str, Any], schema: Mapping[str, Any], path: str) -> None:
        if path == "metadata":
            return  # checked by _check_metadata; the API server owns the rest
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            self.problems.add(path, f"must have at most {schema['maxProperties']} fields (got {len(value)})")
        props: Mapping[str, Any] = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        opaque = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        for key in list(value):
            sub = props.get(key, extra if isinstance(extra, Mapping) else None)
            if sub is None:
                if not opaque:
                    self._unknown_field(value, key, join(path, key), props)
            elif value[key] is None and not sub.get("nullable"):
                del value[key]  # the API server prunes nulls of non-nullable fields
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        for key in schema.get("required", []):
            if key not in value:
                self.problems.add(join(path, key), "required")
        for key in list(value):
            sub = props.get(key, extra if isinstance(extra, Mapping) else None)
            if sub is not None:
                value[key] = self.walk(value[key], sub, join(path, key))


# Fields of earlier versions of v1alpha1, and what took their place.
REPLACED = {"spec.training.adagrad": "replaced by spec.training.optimizer (adagrad | sgd)"}


def _unknown(key: str, props: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(props), n=1)
    return f"unknown field (did you mean {close[0]}?)" if close else "unknown field"


def _is_integer(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": _is_integer,
    "number": _is_number,
    "boolean": lambda v: isinstance(v, bool),
}


@functools.lru_cache(maxsize=256)
def regex(pattern: str) -> re.Pattern[str]:
    """An ECMA/RE2 pattern in Python: an unescaped ``$`` outside a class means end of text."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if ch == "[":
            in_class = True
        elif ch == "]":
            in_class = False
        out.append(r"\Z" if ch == "$" and not in_class else ch)
        i += 1
    return re.compile("".join(out))


def _is_date_time(text: str) -> bool:
    try:
        datetime.datetime.fromisoformat(text)
    except ValueError:
        return False
    return "T" in text.upper()


def at_path(doc: Any, *keys: str) -> Any:
    """doc[keys[0]][keys[1]]..., or None where a key is missing or a value not a mapping."""
    for key in keys:
        if not isinstance(doc, Mapping):
            return None
        doc = doc.get(key)
    return doc
