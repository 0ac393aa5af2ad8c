"""The docs keep up with the code: every spec field is described in the CRD and in the field
reference, every test security.md cites exists, every tests/ path the docs name exists, and
every link between the README and docs/ leads to a file and a heading that are there."""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Any, Iterator

from distbelief.operator.validation import spec

from support.paths import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _leaf_paths(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    properties = node.get("properties")
    if not properties or node.get("x-kubernetes-preserve-unknown-fields"):
        yield path, node
        return
    if path.endswith((".resources", ".template")):
        yield path, node  # requests/limits, and a role's pod template, are described together
        return
    for name, child in properties.items():
        yield from _leaf_paths(child, f"{path}.{name}")


def test_every_spec_field_is_described_in_the_crd_and_in_the_reference() -> None:
    """The CRD's descriptions are the only place a field's meaning is written down
    (docs/reference.md is generated from them): a field without one is undocumented."""
    reference = (REPO / "docs" / "reference.md").read_text()
    leaves = list(_leaf_paths(spec.openapi_schema()["properties"]["spec"], "spec"))
    assert len(leaves) > 60
    undescribed = [path for path, node in leaves if not node.get("description", "").strip()]
    assert not undescribed, f"the CRD gives these fields no description: {undescribed}"
    missing = [path for path, _ in leaves if f"| `{path}` |" not in reference]
    assert not missing, f"docs/reference.md lacks {missing}: run tools/gen-reference"


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
    named = {(doc.relative_to(REPO).as_posix(), path.rstrip(".")) for doc in DOCUMENTS
             for path in re.findall(r"\btests/[\w/*.]*\w", doc.read_text())}
    assert any(path.startswith("tests/unit/") for _, path in named)
    assert any(path.startswith("tests/nodes") for _, path in named)
    missing = sorted(f"{doc}: {path}" for doc, path in named if not list(REPO.glob(path)))
    assert not missing, f"the docs name test paths that do not exist: {missing}"


def _prose(text: str) -> str:
    """Markdown without its fenced code blocks and code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped but
    for hyphens, spaces as hyphens, a repeated one numbered."""
    seen: collections.Counter[str] = collections.Counter()
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return anchors


def _links(doc: Path) -> Iterator[tuple[Path, str]]:
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s): and the like
        path, _, anchor = target.partition("#")
        yield (doc.parent / path).resolve() if path else doc, anchor


def test_every_link_between_the_docs_leads_somewhere() -> None:
    """A relative link of the README or docs/ names a file that exists and, with #anchor,
    a heading of that file: moving a section must move its links."""
    checked, broken = 0, []
    for doc in DOCUMENTS:
        for target, anchor in _links(doc):
            checked += 1
            where = f"{doc.relative_to(REPO)} -> {target.relative_to(REPO) if target.is_relative_to(REPO) else target}"
            if not target.exists():
                broken.append(f"{where}: no such file")
            elif anchor and (target.suffix != ".md" or anchor not in _anchors(target.read_text())):
                broken.append(f"{where}#{anchor}: no such heading")
    assert checked > 100
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_stays_an_introduction() -> None:
    """The manual is in docs/: the README says what the project is, how to try it and where
    to read on, and links every page of docs/."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    linked = {target for target, _ in _links(REPO / "README.md")}
    unlinked = [doc.relative_to(REPO).as_posix() for doc in DOCUMENTS[1:] if doc.resolve() not in linked]
    assert not unlinked, f"the README does not link {unlinked}"
