"""The layering of docs/architecture.md, checked on the import graph: the import-linter
contracts of pyproject.toml hold (lint-imports, in a child process), they forbid the
operator process every runtime folder but the dependency-free modules, and
tools/import-graph prints the folders in layer order (the rest of the checks on the
source: unit/test_source_layout.py)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from support.paths import REPO

RUNTIME = REPO / "runtime" / "distbelief" / "runtime"
# The runtime modules the operator process may import: dependency-free, beside the layers.
RUNTIME_FOR_THE_OPERATOR = {"contract", "jobspec", "jobresolve", "jobbase", "keys", "keyfiles", "errors"}


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


def test_only_a_shard_s_update_rule_loads_numba() -> None:
    """numba costs about half a second to import: the roles' modules (a worker's all it
    runs) never load it; the first update rule a shard makes does."""
    code = ("import sys\n"
            "import distbelief.runtime.roles.worker, distbelief.runtime.roles.ps\n"
            "print('numba' in sys.modules)\n"
            "from distbelief.runtime.params.optim import make_optimizer\n"
            "make_optimizer('sgd', 10, learning_rate=0.1)\n"
            "print('numba' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
