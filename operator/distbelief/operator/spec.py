"""Validation of DistBeliefJob manifests, driven by the CustomResourceDefinition file.

The CRD in ``crds/`` is the one source of truth of the job schema; this module never
restates it. It reads the CRD's structural ``openAPIV3Schema`` and, like the API
server, applies its defaults and checks its rules (types, bounds, enums, patterns,
required and unknown fields). On top of that it checks what an OpenAPI schema cannot
say: name lengths that derived child names must fit, min <= max, mutually exclusive
fields, the data-source grammar and durations. Every problem is reported as one line,
``<json path>: <rule>``, and all of them together in one :class:`SpecError`.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import functools
import importlib.resources
import json
import logging
import os
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from distbelief.runtime import contract

log = logging.getLogger(__name__)

CRD_ENV = "DISTBELIEF_CRD"
CRD_PACKAGE = "distbelief.operator"
CRD_RESOURCE = "crds/distbelief.io_distbeliefjobs.yaml"
JOB_API_VERSION = f"{contract.API_GROUP}/{contract.API_VERSION}"

BUILTIN_DATASETS: tuple[str, ...] = ("digits",)

# Every schema keyword the validator understands. A CRD using any other keyword is
# refused at load time, so that no rule is ever skipped silently.
SUPPORTED_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "enum",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
    "maxLength", "pattern", "minItems", "maxItems", "default", "nullable", "anyOf",
    "format", "description", "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
})

# Services and StatefulSets need RFC 1035 labels (start with a letter); namespaces are
# RFC 1123 labels (may start with a digit).
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?\Z")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")
_SHOW_MAX = 60


class SpecError(ValueError):
    """A manifest the user wrote is wrong; ``errors`` holds one line per problem."""

    def __init__(self, errors: Iterable[str] | str) -> None:
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(self.errors)


# --------------------------------------------------------------------------- CRD


def load_crd() -> dict[str, Any]:
    """The CRD as a dict: ``$DISTBELIEF_CRD`` if set, else the copy shipped in the package."""
    return copy.deepcopy(_cached_crd(os.environ.get(CRD_ENV) or None))


def openapi_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the served version (v1alpha1) of the CRD."""
    return copy.deepcopy(_schema())


def _schema() -> dict[str, Any]:
    return _cached_schema(os.environ.get(CRD_ENV) or None)


@functools.lru_cache(maxsize=8)
def _cached_crd(override: str | None) -> dict[str, Any]:
    if override:
        text, origin = Path(override).read_text(encoding="utf-8"), override
    else:
        ref = importlib.resources.files(CRD_PACKAGE).joinpath(CRD_RESOURCE)
        text, origin = ref.read_text(encoding="utf-8"), f"{CRD_PACKAGE}:{CRD_RESOURCE}"
    crd = yaml.safe_load(text)
    if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
        raise RuntimeError(f"{origin}: not a CustomResourceDefinition")
    log.debug("loaded crd origin=%s", origin)
    return crd


@functools.lru_cache(maxsize=8)
def _cached_schema(override: str | None) -> dict[str, Any]:
    for version in _cached_crd(override)["spec"]["versions"]:
        if version.get("name") == contract.API_VERSION:
            schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
            unsupported = sorted(set(_unsupported_keywords(schema, "")))
            if unsupported:
                raise RuntimeError("CRD uses schema keywords the validator does not "
                                   f"support: {', '.join(unsupported)}")
            return schema
    raise RuntimeError(f"CRD has no version {contract.API_VERSION}")


def _unsupported_keywords(schema: Mapping[str, Any], path: str) -> Iterator[str]:
    for key in schema:
        if key not in SUPPORTED_KEYWORDS:
            yield f"{path or '(root)'}: {key}"
    for name, sub in schema.get("properties", {}).items():
        yield from _unsupported_keywords(sub, _join(path, name))
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), Mapping):
            yield from _unsupported_keywords(schema[key], f"{path}[*]")
    for branch in schema.get("anyOf", []):
        yield from _unsupported_keywords(branch, path)


# ------------------------------------------------------------------ public checks


def validate_job(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``doc`` with the CRD's defaults applied; SpecError lists every problem."""
    if not isinstance(doc, Mapping):
        raise SpecError(f"manifest: must be a mapping (got {_kind(doc)})")
    problems = _Problems()
    job: dict[str, Any] = copy.deepcopy(dict(doc))
    job = _Walker(problems).walk(job, _schema(), "")
    _check_identity(job, problems)
    _check_metadata(job.get("metadata"), problems)
    _check_model(doc, problems)
    _check_data(job, problems)
    _check_training(job, problems)
    _check_autoscaling(job, problems)
    if problems.lines:
        raise SpecError(problems.lines)
    return job


def job_config(
    validated: Mapping[str, Any], namespace_default: str = "default"
) -> contract.JobConfig:
    """The resolved config the pods read, from the output of :func:`validate_job`."""
    metadata = validated["metadata"]
    return contract.JobConfig(
        name=metadata["name"],
        namespace=metadata.get("namespace") or namespace_default,
        spec=copy.deepcopy(validated["spec"]),
    )


def load_manifests(path: str) -> list[dict[str, Any]]:
    """Every non-empty YAML document in ``path``; each must be a mapping."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise SpecError(_yaml_problem(path, exc)) from None
    bad = [f"{path}: document {i}: must be a mapping (got {_kind(d)})"
           for i, d in enumerate(docs, 1) if d is not None and not isinstance(d, dict)]
    if bad:
        raise SpecError(bad)
    return [d for d in docs if d is not None]


def _yaml_problem(path: str, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return f"{path}: not valid YAML: {where}{' '.join(str(problem).split())}"


# ------------------------------------------------------------- problem bookkeeping


class _Problems:
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


def _join(path: str, key: str) -> str:
    if _PLAIN_KEY.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    for py, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                     (list, "array"), (dict, "object")):
        if isinstance(value, py):
            return name
    return type(value).__name__


def _show(value: Any) -> str:
    """A value as one short line of JSON."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _SHOW_MAX else text[: _SHOW_MAX - 3] + "..."


def _got(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return f"got {_kind(value)}"
    return f"got {_kind(value)} {_show(value)}"


# -------------------------------------------------------------- the schema walker


class _Walker:
    """Applies defaults and checks one structural schema, the way the API server does."""

    def __init__(self, problems: _Problems) -> None:
        self.problems = problems

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
            self.problems.add(path, f"must be an integer or a string ({_got(value)})")
            return False
        wanted = schema.get("type")
        if wanted is None or _TYPE_CHECKS[wanted](value):
            return True
        self.problems.add(path, f"must be of type {wanted} ({_got(value)})")
        return False

    def _any_of_ok(self, value: Any, schema: Mapping[str, Any], path: str) -> bool:
        branches = schema.get("anyOf")
        if not branches:
            return True
        for branch in branches:
            trial = _Problems()
            _Walker(trial).walk(copy.deepcopy(value), branch, path)
            if not trial.lines:
                return True
        self.problems.add(path, f"must match one of the anyOf schemas ({_got(value)})")
        return False

    def _enum(self, value: Any, schema: Mapping[str, Any], path: str) -> None:
        allowed = schema.get("enum")
        if allowed is not None and value not in allowed:
            choices = ", ".join(map(str, allowed))
            self.problems.add(path, f"must be one of {choices} ({_got(value)})")

    def _number(self, value: int | float, schema: Mapping[str, Any], path: str) -> int | float:
        if isinstance(value, float) and (
            schema.get("type") == "integer" or schema.get("x-kubernetes-int-or-string")
        ):
            value = int(value)
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None:
            if schema.get("exclusiveMinimum") and not value > low:
                self.problems.add(path, f"must be > {_show(low)} (got {_show(value)})")
            elif value < low:
                self.problems.add(path, f"must be >= {_show(low)} (got {_show(value)})")
        if high is not None:
            if schema.get("exclusiveMaximum") and not value < high:
                self.problems.add(path, f"must be < {_show(high)} (got {_show(value)})")
            elif value > high:
                self.problems.add(path, f"must be <= {_show(high)} (got {_show(value)})")
        return value

    def _string(self, value: str, schema: Mapping[str, Any], path: str) -> None:
        if "minLength" in schema and len(value) < schema["minLength"]:
            self.problems.add(path, f"must be at least {schema['minLength']} characters "
                                    f"(got {len(value)}: {_show(value)})")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            self.problems.add(path, f"must be at most {schema['maxLength']} characters "
                                    f"(got {len(value)})")
        if "pattern" in schema and not _regex(schema["pattern"]).search(value):
            self.problems.add(path, f"must match {schema['pattern']} (got {_show(value)})")
        if schema.get("format") == "date-time" and not _is_date_time(value):
            self.problems.add(path, f"must be an RFC 3339 date-time (got {_show(value)})")

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

    def _object(self, value: dict[str, Any], schema: Mapping[str, Any], path: str) -> None:
        if path == "metadata":
            return  # checked by _check_metadata; the API server owns the rest
        props: Mapping[str, Any] = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        opaque = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        for key in list(value):
            sub = props.get(key, extra if isinstance(extra, Mapping) else None)
            if sub is None:
                if not opaque:
                    where = _join(path, key)
                    self.problems.add(where, REPLACED.get(where) or _unknown(key, props))
            elif value[key] is None and not sub.get("nullable"):
                del value[key]  # the API server prunes nulls of non-nullable fields
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        for key in schema.get("required", []):
            if key not in value:
                self.problems.add(_join(path, key), "required")
        for key in list(value):
            sub = props.get(key, extra if isinstance(extra, Mapping) else None)
            if sub is not None:
                value[key] = self.walk(value[key], sub, _join(path, key))


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
def _regex(pattern: str) -> re.Pattern[str]:
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


# ---------------------------------------------------- rules the schema cannot say


def _get(doc: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(doc, Mapping):
            return None
        doc = doc.get(key)
    return doc


def _check_identity(job: Mapping[str, Any], problems: _Problems) -> None:
    for field, wanted in (("apiVersion", JOB_API_VERSION), ("kind", contract.KIND)):
        if field not in job:
            problems.add(field, f"required, must be {wanted}")
        elif not problems.at(field) and job[field] != wanted:
            problems.add(field, f"must be {wanted} ({_got(job[field])})")


def _check_metadata(metadata: Any, problems: _Problems) -> None:
    if metadata is None:
        problems.add("metadata", "required")
        return
    if not isinstance(metadata, Mapping) or problems.at("metadata"):
        return
    name = metadata.get("name")
    if name is None:
        problems.add("metadata.name", "required")
    elif not isinstance(name, str):
        problems.add("metadata.name", f"must be of type string ({_got(name)})")
    else:
        _check_job_name(name, problems)
    namespace = metadata.get("namespace")
    if namespace is not None and not (
        isinstance(namespace, str) and len(namespace) <= contract.DNS_LABEL_MAX
        and _DNS1123_LABEL.match(namespace)
    ):
        problems.add("metadata.namespace", "must be a DNS-1123 label: at most "
                     f"{contract.DNS_LABEL_MAX} lowercase alphanumerics or '-', starting "
                     f"and ending alphanumeric ({_got(namespace)})")


def _check_job_name(name: str, problems: _Problems) -> None:
    if not _DNS1035_LABEL.match(name):
        problems.add("metadata.name", "must be a DNS-1123 label: lowercase alphanumerics or "
                     f"'-', starting with a letter and ending alphanumeric (got {_show(name)})")
    if len(name) > contract.MAX_JOB_NAME:
        problems.add("metadata.name", f"must be at most {contract.MAX_JOB_NAME} characters "
                     f"(got {len(name)}) so that derived names such as "
                     f"<name>{contract.PS_SUFFIX}-<i> and the StatefulSet's revision label fit "
                     f"in {contract.DNS_LABEL_MAX}")


def _check_model(raw: Mapping[str, Any], problems: _Problems) -> None:
    model = _get(raw, "spec", "model")
    if isinstance(model, Mapping) and model.get("entrypoint") is not None \
            and model.get("type") is not None:
        problems.add("spec.model.entrypoint", "not allowed together with spec.model.type "
                     "(a model is either built in or user code)")
    if isinstance(model, Mapping) and model.get("entrypoint") is not None \
            and model.get("embeddings") is not None:
        problems.add("spec.model.embeddings", "not available with spec.model.entrypoint (user models "
                     "see one flat parameter vector)")
    if _get(raw, "spec", "model", "embeddings") is not None \
            and _get(raw, "spec", "training", "algorithm") == "sandblaster":
        problems.add("spec.model.embeddings", "needs spec.training.algorithm: downpour (Sandblaster's "
                     "L-BFGS runs over the dense parameters only)")


def _check_data(job: Mapping[str, Any], problems: _Problems) -> None:
    path = "spec.data.source"
    source = _get(job, "spec", "data", "source")
    if not isinstance(source, str) or problems.at(path):
        return
    scheme, _, body = source.partition(":")
    if scheme == "builtin" and body not in BUILTIN_DATASETS:
        problems.add(path, f"unknown builtin data set {_show(body)} "
                     f"(known: {', '.join(BUILTIN_DATASETS)})")
    elif scheme == "synthetic":
        for problem in contract.synthetic_params(body)[1]:
            problems.add(path, problem)
    elif scheme == "synthetic-ctr":
        for problem in contract.ctr_params(body)[1]:
            problems.add(path, problem)
        if _get(job, "spec", "model", "embeddings") is None:
            problems.add(path, "synthetic-ctr data holds only ids: set spec.model.embeddings to embed them")
    elif scheme == "npz" and not posixpath.isabs(body):
        problems.add(path, f"npz path must be absolute inside the pod (got {_show(body)})")


def _check_training(job: Mapping[str, Any], problems: _Problems) -> None:
    path = "spec.training.maxDuration"
    text = _get(job, "spec", "training", "maxDuration")
    if not isinstance(text, str) or problems.at(path):
        return
    try:
        seconds = contract.parse_duration(text)
    except ValueError as exc:
        problems.add(path, str(exc))
        return
    if seconds <= 0:
        problems.add(path, f"must be > 0 (got {_show(text)})")


def _check_autoscaling(job: Mapping[str, Any], problems: _Problems) -> None:
    path = "spec.workers.autoscaling"
    autoscaling = _get(job, "spec", "workers", "autoscaling")
    if not isinstance(autoscaling, Mapping) or problems.at(path):
        return
    low, high = autoscaling.get("minReplicas"), autoscaling.get("maxReplicas")
    if isinstance(low, int) and isinstance(high, int) and low > high:
        problems.add(f"{path}.minReplicas", f"must be <= maxReplicas (got {low} > {high})")
