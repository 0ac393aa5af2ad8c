"""The unit tier: every test's setup, call and teardown run without sockets or processes
(support/isolation.py); a test that needs them belongs in tests/integration."""

from __future__ import annotations

from typing import Iterator

import pytest

from support.isolation import no_sockets_or_processes


def pytest_configure(config: pytest.Config) -> None:
    """matplotlib (the report's plot) lists the system's fonts with fc-list the first time it
    runs on a machine: done here, before any test's isolation, so the plot's tests see a
    warm font cache."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with no_sockets_or_processes():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with no_sockets_or_processes():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with no_sockets_or_processes():
        yield
