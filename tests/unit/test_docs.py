"""The docs keep up with the code: every spec field is in the README, every test security.md cites exists."""

from __future__ import annotations

import re
from typing import Any, Iterator

from distbelief.operator.spec import spec

from support.paths import REPO


def _leaf_paths(node: dict[str, Any], path: str) -> Iterator[str]:
    properties = node.get("properties")
    if not properties or node.get("x-kubernetes-preserve-unknown-fields"):
        yield path
        return
    if path.endswith((".resources", ".template")):
        yield path  # requests/limits, and a role's pod template, are documented together
        return
    for name, child in properties.items():
        yield from _leaf_paths(child, f"{path}.{name}")


def test_every_spec_field_is_in_the_readme_reference() -> None:
    readme = (REPO / "README.md").read_text()
    missing = [p for p in _leaf_paths(spec.openapi_schema()["properties"]["spec"], "spec")
               if f"`{p}" not in readme]
    assert not missing, f"README.md's field reference lacks {missing}"


def test_every_test_security_md_cites_exists() -> None:
    """docs/security.md backs each promise with a test: the names must stay real."""
    text = (REPO / "docs" / "security.md").read_text()
    cited = set(re.findall(r"tests/((?:\w+/)*test_\w+\.py)::(test_\w+)", text))
    assert len(cited) >= 20
    missing = sorted(f"{file}::{name}" for file, name in cited
                     if not (REPO / "tests" / file).is_file() or f"def {name}(" not in (REPO / "tests" / file).read_text())
    assert not missing, f"docs/security.md cites tests that do not exist: {missing}"


def test_every_tests_path_the_docs_name_exists() -> None:
    """A test file or folder the README or docs/ name (globs too) is where they say."""
    documents = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = {(doc.name, path.rstrip(".")) for doc in documents
             for path in re.findall(r"\btests/[\w/*.]*\w", doc.read_text())}
    assert any(path.startswith("tests/unit/") for _, path in named)
    missing = sorted(f"{doc}: {path}" for doc, path in named if not list(REPO.glob(path)))
    assert not missing, f"the docs name test paths that do not exist: {missing}"
