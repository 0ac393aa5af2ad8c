"""One way to wait: poll a condition instead of sleeping a fixed time."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def eventually(predicate: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "") -> T:
    """predicate()'s first truthy value within timeout seconds; AssertionError (naming what,
    and the last value) otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what or predicate}; last value {value!r}")
        time.sleep(interval)
