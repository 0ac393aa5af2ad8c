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
CLUSTER_MODULES = ("cluster/handlers", "cluster/kube", "cluster/peering", "render/render", "render/podparts",
                   "render/context", "spec/spec", "status/status", "status/scrape")
RUNTIME_FOR_THE_OPERATOR = {"distbelief.runtime", "distbelief.runtime.contract", "distbelief.runtime.keys",
                            "distbelief.runtime.errors"}
CORE = ("wire/protocol", "transport/zmq_transport", "transport/zmq_server", "transport/zmq_link", "transport/fanout",
        "transport/memory_transport", "shard/plugin", "shard/core", "shard/copies/replication")
ALGORITHM_MODULES = ("distbelief.runtime.params", "distbelief.runtime.algorithms", "distbelief.runtime.roles",
                     "distbelief.runtime.model")


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


def test_only_the_transport_and_the_keys_import_zeromq() -> None:
    users = [p.relative_to(RUNTIME).as_posix() for p in modules(RUNTIME) + modules(OPERATOR)
             if any(m == "zmq" or m.startswith("zmq.") for m in imports(p))]
    assert sorted(users) == ["keys.py", "transport/admission.py", "transport/zmq_link.py", "transport/zmq_server.py",
                             "transport/zmq_transport.py"]


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
