"""Reading manifest files: YAML documents, each a mapping, as kubectl would take them.

Stricter than a plain YAML load where a silent reading would surprise: a file with no
manifest is an error, and so is a key given twice in one mapping (YAML would keep the
last one without a word). A kubectl `kind: List` is unpacked into its items.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from distbelief.operator import errors
from distbelief.operator.validation.schemawalk import kind


class _DuplicateKey(yaml.MarkedYAMLError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with the same key twice."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(problem=f"duplicate key {key!r} (YAML would keep only the last one)",
                                    problem_mark=key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _StrictLoader.construct_mapping)


def load_manifests(path: str) -> list[dict[str, Any]]:
    """Every non-empty YAML document in ``path`` (a List's items in its place); each
    must be a mapping, and there must be at least one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.SpecError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        docs = list(yaml.load_all(text, Loader=_StrictLoader))  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise errors.SpecError(_yaml_problem(path, exc)) from None
    docs = [item for doc in docs for item in _unpack_list(doc)]
    bad = [f"{path}: document {i}: must be a mapping (got {kind(d)})"
           for i, d in enumerate(docs, 1) if d is not None and not isinstance(d, dict)]
    if bad:
        raise errors.SpecError(bad)
    manifests = [d for d in docs if d is not None]
    if not manifests:
        raise errors.SpecError(f"{path}: holds no manifest (the file is empty or only comments)")
    return manifests


def load_single(path: str, command: str) -> dict[str, Any]:
    """The one manifest of a file a command takes alone (run, predict)."""
    docs = load_manifests(path)
    if len(docs) != 1:
        raise errors.SpecError(f"{path}: {command} takes one DistBeliefJob per file, found {len(docs)} documents")
    return docs[0]


def _unpack_list(doc: Any) -> list[Any]:
    """A kubectl List's items (`kubectl get dbj -o yaml` writes one), else [doc]."""
    if not (isinstance(doc, dict) and doc.get("kind") == "List" and doc.get("apiVersion") == "v1"):
        return [doc]
    items = doc.get("items")
    return items if isinstance(items, list) else [items]


def _yaml_problem(path: str, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return f"{path}: not valid YAML: {where}{' '.join(str(problem).split())}"

