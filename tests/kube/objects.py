"""Pure functions on object dicts: patches, selectors, Scale and Table views, timestamps."""

from __future__ import annotations

import copy
import datetime
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jsonpatch
import jsonpointer

from .catalog import ResourceType, ScalePaths


class PatchError(ValueError):
    """A patch that cannot be applied (a failed JSON-patch ``test`` among others): 422."""


class MalformedPatch(ValueError):
    """A patch that is not a patch of its declared type at all: 400."""


# ------------------------------------------------------------------------ patches


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A naive strategic merge patch, enough for kubectl apply on built-in kinds.

    Like a merge patch, except that lists of dicts which all carry a ``name`` (containers,
    env, ports, volumes, volumeMounts) are merged item by item by name, and the directives
    kubectl sends are understood: ``$patch: replace|delete``, ``$retainKeys``,
    ``$deleteFromPrimitiveList/<field>``; ``$setElementOrder/<field>`` is ignored.
    """
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$patch", "$retainKeys"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list):
                result[field] = [v for v in result[field] if v not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _merge_list(result[key], value)
        else:
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
    if isinstance(patch.get("$retainKeys"), list):
        result = {k: v for k, v in result.items() if k in patch["$retainKeys"]}
    return result


def _merge_list(current: list[Any], patch: list[Any]) -> list[Any]:
    def named(items: list[Any]) -> bool:
        return all(isinstance(i, Mapping) and "name" in i for i in items)

    if any(isinstance(i, Mapping) and i.get("$patch") == "replace" for i in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, Mapping) and "$patch" in i)]
    if not patch or not named(current) or not named(patch):
        return copy.deepcopy([i for i in patch if not (isinstance(i, Mapping) and "$patch" in i)])
    merged = {item["name"]: item for item in current}
    for item in patch:
        if item.get("$patch") == "delete":
            merged.pop(item["name"], None)
        else:
            merged[item["name"]] = strategic_merge_patch(merged.get(item["name"]), item)
    return list(merged.values())


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch, ``test`` operations included (kopf guards with them)."""
    if not isinstance(ops, list):
        raise MalformedPatch(f"an application/json-patch+json patch must be a list of operations, not "
                             f"{type(ops).__name__}; a dict is a merge patch (application/merge-patch+json)")
    try:
        return jsonpatch.apply_patch(target, ops)
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException, TypeError, KeyError) as exc:
        raise PatchError(str(exc)) from None


PATCHES: dict[str, Callable[[Any, Any], Any]] = {
    "application/merge-patch+json": merge_patch,
    "application/strategic-merge-patch+json": strategic_merge_patch,
    "application/json-patch+json": json_patch,
}


# ---------------------------------------------------------------------- selectors

_REQUIREMENT = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9][-A-Za-z0-9_./]*)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[-A-Za-z0-9_.]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?\s*$")

Requirement = Callable[[Mapping[str, str]], bool]


def parse_label_selector(text: str | None) -> list[Requirement]:
    """``a=b,c!=d,e,!f,g in (x,y),h notin (z)`` as a list of predicates on a labels dict."""
    if not text:
        return []
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [_requirement(part) for part in parts if part.strip()]


def _requirement(text: str) -> Requirement:
    m = _REQUIREMENT.match(text)
    if not m or (m["neg"] and (m["op"] or m["setop"])):
        raise ValueError(f"unable to parse requirement: {text.strip()!r}")
    key, value = m["key"], m["value"]
    if m["op"] in ("=", "=="):
        return lambda labels: labels.get(key) == value
    if m["op"] == "!=":
        return lambda labels: labels.get(key) != value
    if m["setop"]:
        values = {v.strip() for v in m["values"].split(",") if v.strip()}
        if m["setop"] == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if m["neg"]:
        return lambda labels: key not in labels
    return lambda labels: key in labels


def parse_field_selector(text: str | None) -> list[Callable[[Mapping[str, Any]], bool]]:
    """``metadata.name=x,status.phase!=Running``: equality on dotted fields of the object."""
    if not text:
        return []
    result = []
    for part in text.split(","):
        m = re.match(r"^\s*([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*?)\s*$", part)
        if not m:
            raise ValueError(f"invalid field selector: {part.strip()!r}")
        path, op, value = tuple(m[1].split(".")), m[2], m[3]

        def check(obj: Mapping[str, Any], path: tuple[str, ...] = path, op: str = op, value: str = value) -> bool:
            found = lookup(obj, path)
            text = "" if found is None else str(found).lower() if isinstance(found, bool) else str(found)
            return (text == value) == (op != "!=")
        result.append(check)
    return result


def selector_string(selector: Any) -> str:
    """A LabelSelector object (matchLabels, matchExpressions) as the equivalent string."""
    if not isinstance(selector, Mapping):
        return ""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        op, key, values = expr.get("operator"), expr.get("key"), ",".join(expr.get("values") or [])
        parts.append({"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})",
                      "Exists": f"{key}", "DoesNotExist": f"!{key}"}.get(op, ""))
    return ",".join(p for p in parts if p)


def lookup(doc: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(doc, Mapping):
            return None
        doc = doc.get(key)
    return doc


def assign(doc: dict[str, Any], path: Sequence[str], value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(doc.get(key), dict):
            doc[key] = {}
        doc = doc[key]
    doc[path[-1]] = value


# -------------------------------------------------------------------------- views


def scale_of(rt: ResourceType, obj: Mapping[str, Any]) -> dict[str, Any]:
    """The autoscaling/v1 Scale of an object, read through the type's scale paths."""
    paths: ScalePaths = rt.scale  # type: ignore[assignment]
    meta = obj["metadata"]
    status: dict[str, Any] = {"replicas": lookup(obj, paths.status_replicas) or 0}
    if paths.selector:
        selector = lookup(obj, paths.selector)
        selector = selector_string(selector) if paths.selector_is_object else selector
        if selector:
            status["selector"] = selector
    return {
        "kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                     if k in meta},
        "spec": {"replicas": lookup(obj, paths.spec_replicas) or 0},
        "status": status,
    }


def partial_metadata(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": copy.deepcopy(obj.get("metadata") or {})}


def table(rt: ResourceType, objects: Sequence[Mapping[str, Any]], resource_version: str,
          include: str = "PartialObjectMetadata", now: datetime.datetime | None = None) -> dict[str, Any]:
    """A meta.k8s.io/v1 Table, as ``kubectl get`` asks for: Name, the CRD's printer columns
    (or just Age for built-in kinds), date columns rendered as ages like the API server does."""
    now = now or utcnow()
    columns = list(rt.columns) or [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    definitions = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                    "description": "Name must be unique within a namespace."}]
    definitions += [{"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
                     "description": c.get("description", ""), "priority": c.get("priority", 0)} for c in columns]
    rows = []
    for obj in objects:
        cells: list[Any] = [obj["metadata"]["name"]]
        for column in columns:
            value = lookup(obj, column["jsonPath"].lstrip(".").split("."))
            if column.get("type") == "date" and isinstance(value, str):
                value = human_age(now - parse_time(value))
            cells.append(value)
        row: dict[str, Any] = {"cells": cells}
        if include == "Object":
            row["object"] = copy.deepcopy(dict(obj))
        elif include != "None":
            row["object"] = partial_metadata(obj)
        rows.append(row)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": definitions, "rows": rows}


# --------------------------------------------------------------------------- time


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def timestamp(moment: datetime.datetime | None = None) -> str:
    """RFC 3339 in UTC with seconds, as metav1.Time serialises: ``2024-05-01T12:00:00Z``."""
    return (moment or utcnow()).astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def human_age(delta: datetime.timedelta) -> str:
    """The API server's short human durations: 45s, 3m12s, 25m, 5h3m, 3d4h, 400d, 2y30d."""
    seconds = int(delta.total_seconds())
    if seconds < 0:
        return "0s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 192:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 730:
        return f"{days}d"
    years = days // 365
    return f"{years}y{days % 365}d" if years < 8 and days % 365 else f"{years}y"
