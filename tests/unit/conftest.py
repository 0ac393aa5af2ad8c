"""The unit tier: every test's setup, call and teardown run without sockets or processes
(support/isolation.py); a test that needs them belongs in tests/integration."""

from __future__ import annotations

from typing import Iterator

import pytest

from support.isolation import no_sockets_or_processes


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
