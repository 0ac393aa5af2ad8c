"""The operator's process settings: kopf's handler threads, and one API client for them all."""

from __future__ import annotations

import kopf
import pytest

from distbelief.operator.cluster import handlers, kube


def test_the_handlers_run_on_their_own_thread_count_and_share_one_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "_load_kube_config", lambda: None)
    monkeypatch.setattr(kube, "_SHARED", None)
    assert kube.Kube().api is not kube.Kube().api   # before the operator's start: a client each
    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings)
    assert settings.execution.max_workers == handlers.HANDLER_THREADS == 32
    first, second = kube.Kube(), kube.Kube()
    assert first.api is second.api
    # A connection kept for every thread that shares the client, and the watches beside them.
    assert first.api.rest_client.pool_manager.connection_pool_kw["maxsize"] == handlers.HANDLER_THREADS + 8
