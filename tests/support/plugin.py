"""The one way tests run `kubectl distbelief`: the installed `kubectl-distbelief`, found by
kubectl on the PATH as a plugin (with a kubectl), or run itself (without one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent   # the venv's bin: where the wheel installed kubectl-distbelief


def command(*args: str, kubectl: str | None = None) -> list[str]:
    return [kubectl, "distbelief", *args] if kubectl else [str(BIN / "kubectl-distbelief"), *args]


def environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """env over this process's, with the venv's bin first on the PATH (where kubectl looks)."""
    merged = {**os.environ, **(env or {})}
    return {**merged, "PATH": f"{BIN}{os.pathsep}{merged.get('PATH', '')}"}


def run_plugin(*args: str, kubectl: str | None = None, env: dict[str, str] | None = None, timeout: float = 60,
               **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """`kubectl distbelief args...` (or `kubectl-distbelief args...` without kubectl), its
    output captured as text. Never raises on a failing exit code."""
    return subprocess.run(command(*args, kubectl=kubectl), env=environment(env), capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def columns(table: str) -> list[dict[str, str]]:
    """A printed table whose cells are one word each (`get`'s, `top`'s) as one dict per row."""
    header, *rows = table.strip().splitlines()
    return [dict(zip(header.split(), row.split())) for row in rows]
