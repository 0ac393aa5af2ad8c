"""Where things are: the repository, the tests folder (tests/user_model.py for entrypoint
jobs), the example jobs."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
EXAMPLES = REPO / "examples"
