"""The README keeps up with the CRD: every spec field is in its field reference."""

from __future__ import annotations

from typing import Any, Iterator

from distbelief.operator import spec

from conftest import REPO


def _leaf_paths(node: dict[str, Any], path: str) -> Iterator[str]:
    properties = node.get("properties")
    if not properties or node.get("x-kubernetes-preserve-unknown-fields"):
        yield path
        return
    if path.endswith(".resources"):
        yield path  # requests/limits are documented together
        return
    for name, child in properties.items():
        yield from _leaf_paths(child, f"{path}.{name}")


def test_every_spec_field_is_in_the_readme_reference() -> None:
    readme = (REPO / "README.md").read_text()
    missing = [p for p in _leaf_paths(spec.openapi_schema()["properties"]["spec"], "spec")
               if f"`{p}" not in readme]
    assert not missing, f"README.md's field reference lacks {missing}"
