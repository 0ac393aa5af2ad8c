"""The layering of docs/architecture.md, checked on the source: what may import what (the
import-linter contracts in pyproject.toml), what each folder says it is for, which modules
may use only the standard library, and how long a module may grow."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from support.paths import REPO

RUNTIME = REPO / "runtime" / "distbelief" / "runtime"
OPERATOR = REPO / "operator" / "distbelief" / "operator"
MAX_LINES = 400
# The runtime modules the operator process may import: dependency-free, beside the layers.
RUNTIME_FOR_THE_OPERATOR = {"contract", "jobspec", "keys", "keyfiles", "errors"}


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


def contracts() -> list[dict]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]["contracts"]


def test_the_import_contracts_hold() -> None:
    """lint-imports over the installed packages: the layers, the forbidden imports, the
    independent algorithms and no import cycle between folders, type-only imports included."""
    done = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())", "--no-cache"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"lint-imports failed:\n{done.stdout}\n{done.stderr}"
    assert "0 broken" in done.stdout


def test_the_operator_process_is_forbidden_every_runtime_folder_but_the_dependency_free_modules() -> None:
    """A new runtime folder is forbidden to the operator process unless it is added here on
    purpose: the forbidden list names every child of the runtime except the allowed ones."""
    (contract,) = [c for c in contracts() if c["name"].startswith("The operator process takes from the runtime")]
    children = {p.stem for p in RUNTIME.glob("*.py") if p.name != "__init__.py"} | {p.name for p in RUNTIME.iterdir()
                                                                                   if (p / "__init__.py").exists()}
    forbidden = {m.removeprefix("distbelief.runtime.") for m in contract["forbidden_modules"]}
    assert forbidden == children - RUNTIME_FOR_THE_OPERATOR


def test_the_folder_graph_is_printed_in_layer_order_without_a_circle() -> None:
    done = subprocess.run([sys.executable, str(REPO / "tools" / "import-graph")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    nodes = [line.split()[0] for line in done.stdout.splitlines()]
    runtime = [n for n in nodes if n.startswith("runtime.")]
    assert runtime.index("runtime.roles") < runtime.index("runtime.algorithms") < runtime.index("runtime.shard") \
        < runtime.index("runtime.transport") < runtime.index("runtime.wire")
    assert len(runtime) <= 16


@pytest.mark.parametrize("folder", packages(RUNTIME) + packages(OPERATOR),
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_folder_says_what_it_is_for(folder: Path) -> None:
    docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8")))
    assert docstring and len(docstring.split()) >= 15, f"{folder.relative_to(REPO)}/__init__.py has no docstring"


def test_no_init_at_the_roots_of_the_namespace_package() -> None:
    """operator/ must never be importable as Python's `operator`; distbelief is a namespace."""
    for root in ("operator", "runtime", "operator/distbelief", "runtime/distbelief"):
        assert not (REPO / root / "__init__.py").exists(), f"{root}/__init__.py"


@pytest.mark.parametrize("path", [RUNTIME / "contract.py", RUNTIME / "jobspec.py", RUNTIME / "errors.py",
                                  OPERATOR / "errors.py"], ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_contract_the_typed_job_and_the_errors_need_only_the_standard_library(path: Path) -> None:
    outside = {m for m in imports(path)
               if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"
               and not m.startswith("__future__.") and m not in ("distbelief.runtime", "distbelief.runtime.jobspec")}
    assert not outside, f"{path.name} imports {sorted(outside)}"


def test_no_runtime_or_operator_module_is_over_400_lines() -> None:
    long = {p.relative_to(REPO).as_posix(): n for p in modules(RUNTIME) + modules(OPERATOR)
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    """The import reader finds both import forms, so the standard-library check can fail."""
    sample = tmp_path / "sample.py"
    sample.write_text("import zmq.utils\nfrom distbelief.runtime import errors\n")
    assert {"zmq.utils", "distbelief.runtime", "distbelief.runtime.errors"} <= imports(sample)
