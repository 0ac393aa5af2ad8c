"""The layering of docs/architecture.md, checked on the source files: what each folder says
it is for, which modules may use only the standard library, how long a module may grow
(the import contracts: integration/test_architecture.py)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from support.paths import REPO

RUNTIME = REPO / "runtime" / "distbelief" / "runtime"
OPERATOR = REPO / "operator" / "distbelief" / "operator"
MAX_LINES = 400
OWN_STDLIB_ONLY = ("distbelief.runtime", "distbelief.runtime.jobspec", "distbelief.runtime.jobresolve",
                   "distbelief.runtime.jobbase")


def imports(path: Path) -> set[str]:
    """Every module a file imports, as dotted names (`from a import b` gives a and a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py"))


def packages(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("__init__.py"))


@pytest.mark.parametrize("folder", packages(RUNTIME) + packages(OPERATOR),
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_folder_says_what_it_is_for(folder: Path) -> None:
    docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8")))
    assert docstring and len(docstring.split()) >= 15, f"{folder.relative_to(REPO)}/__init__.py has no docstring"


def test_no_init_at_the_roots_of_the_namespace_package() -> None:
    """operator/ must never be importable as Python's `operator`; distbelief is a namespace."""
    for root in ("operator", "runtime", "operator/distbelief", "runtime/distbelief"):
        assert not (REPO / root / "__init__.py").exists(), f"{root}/__init__.py"


@pytest.mark.parametrize("path", [RUNTIME / "contract.py", *modules(RUNTIME / "jobspec"), RUNTIME / "jobresolve.py",
                                  RUNTIME / "jobbase.py",
                                  RUNTIME / "errors.py", OPERATOR / "errors.py"],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_contract_the_typed_job_and_the_errors_need_only_the_standard_library(path: Path) -> None:
    outside = {m for m in imports(path)
               if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"
               and not m.startswith(("__future__.", "distbelief.runtime.jobspec.")) and m not in OWN_STDLIB_ONLY}
    assert not outside, f"{path.name} imports {sorted(outside)}"


def test_no_runtime_or_operator_module_is_over_400_lines() -> None:
    """Generated ones too: tools/gen-jobspec splits the typed job into its classes and its resolver."""
    long = {p.relative_to(REPO).as_posix(): n for p in modules(RUNTIME) + modules(OPERATOR)
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    """The import reader finds both import forms, so the standard-library check can fail."""
    sample = tmp_path / "sample.py"
    sample.write_text("import zmq.utils\nfrom distbelief.runtime import errors\n")
    assert {"zmq.utils", "distbelief.runtime", "distbelief.runtime.errors"} <= imports(sample)
