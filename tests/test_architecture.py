"""The layering of docs/architecture.md, checked on the source: what may import what, and
how long a module may grow."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNTIME = REPO / "runtime" / "distbelief" / "runtime"
OPERATOR = REPO / "operator" / "distbelief" / "operator"
MAX_LINES = 400
# The operator process itself (kopf) needs only the contract from the runtime.
CLUSTER_MODULES = ("handlers", "children", "kube", "render", "podparts", "sizing", "spec", "status", "scrape")
RUNTIME_FOR_THE_OPERATOR = {"distbelief.runtime", "distbelief.runtime.contract", "distbelief.runtime.keys",
                            "distbelief.runtime.errors"}
CORE = ("protocol", "transport", "memory_transport", "plugin", "shard")
ALGORITHM_MODULES = ("distbelief.runtime.dense", "distbelief.runtime.sandblaster", "distbelief.runtime.worker",
                     "distbelief.runtime.algorithms")


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


def test_only_the_transport_the_keys_and_the_admission_import_zeromq() -> None:
    users = [p.name for p in modules(RUNTIME) + modules(OPERATOR)
             if any(m == "zmq" or m.startswith("zmq.") for m in imports(p))]
    assert sorted(users) == ["admission.py", "keys.py", "transport.py"]


def test_the_runtime_never_imports_the_operator_nor_kubernetes() -> None:
    for path in modules(RUNTIME):
        bad = {m for m in imports(path) if m.split(".")[0] in ("kopf", "kubernetes")
               or m.startswith("distbelief.operator")}
        assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("name", ["contract", "errors"])
def test_the_contract_and_the_errors_need_only_the_standard_library(name: str) -> None:
    outside = {m for m in imports(RUNTIME / f"{name}.py")
               if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"
               and not m.startswith("__future__.")}
    assert not outside, f"{name}.py imports {sorted(outside)}"


@pytest.mark.parametrize("name", CLUSTER_MODULES)
def test_the_operator_process_takes_only_the_contract_from_the_runtime(name: str) -> None:
    def allowed(module: str) -> bool:  # an allowed module, or a name imported from one
        parent = module.rpartition(".")[0]
        return module in RUNTIME_FOR_THE_OPERATOR or (parent in RUNTIME_FOR_THE_OPERATOR and parent != "distbelief.runtime")

    taken = {m for m in imports(OPERATOR / f"{name}.py") if m.startswith("distbelief.runtime")}
    assert all(allowed(m) for m in taken), f"{name}.py imports {sorted(m for m in taken if not allowed(m))}"


@pytest.mark.parametrize("name", CORE)
def test_the_core_imports_no_algorithm(name: str) -> None:
    path = RUNTIME / f"{name}.py"
    bad = {m for m in imports(path) if m.startswith(ALGORITHM_MODULES)}
    assert not bad, f"{name}.py imports {sorted(bad)}"


def test_no_runtime_or_operator_module_is_over_400_lines() -> None:
    long = {p.relative_to(REPO).as_posix(): n for p in modules(RUNTIME) + modules(OPERATOR)
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    """The import reader finds both import forms, so the checks above can fail."""
    sample = tmp_path / "sample.py"
    sample.write_text("import zmq.utils\nfrom distbelief.runtime import dense\n")
    assert {"zmq.utils", "distbelief.runtime", "distbelief.runtime.dense"} <= imports(sample)
