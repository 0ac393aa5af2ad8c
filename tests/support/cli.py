"""The one way tests run the `distbelief` command: the installed CLI, in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.paths import REPO, TESTS


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 300, env: dict[str, str] | None = None,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """`distbelief args...` from cwd, its output captured as text; tests/ is on PYTHONPATH
    (tests/user_model.py for entrypoint jobs). Never raises on a failing exit code."""
    environment = {**os.environ, "PYTHONPATH": str(TESTS), **(env or {})}
    return subprocess.run([sys.executable, "-m", "distbelief.operator.cli", *args], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=timeout, **kwargs)
