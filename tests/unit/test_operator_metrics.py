"""The operator's own metrics count what its handlers do (cluster/metrics.py); served and
scraped on a real control plane in tests/cluster/test_cluster_operator_metrics.py."""

from __future__ import annotations

import kopf
import prometheus_client as prom
import pytest

from distbelief.operator import errors
from distbelief.operator.cluster import metrics


@pytest.fixture
def counted() -> metrics.OperatorMetrics:
    return metrics.OperatorMetrics(prom.CollectorRegistry())


def value(of: metrics.OperatorMetrics, name: str, **labels: str) -> float | None:
    return of.registry.get_sample_value(name, labels)


def reconcile(of: metrics.OperatorMetrics, outcome: str | None = None, raises: Exception | None = None) -> None:
    with of.reconciling() as attempt:
        if raises is not None:
            raise raises
        if outcome is not None:
            attempt.outcome = outcome


def test_every_outcome_and_handler_shows_at_zero_before_anything_happens(counted: metrics.OperatorMetrics) -> None:
    for outcome in ("applied", "blocked", "invalid_spec", "error"):
        assert value(counted, "distbelief_operator_reconciles_total", outcome=outcome) == 0
    for handler in ("reconcile", "status"):
        assert value(counted, "distbelief_operator_errors_total", handler=handler) == 0
    assert value(counted, "distbelief_operator_jobs", phase="Running") == 0


def test_reconciles_are_counted_by_outcome_and_timed(counted: metrics.OperatorMetrics) -> None:
    reconcile(counted)
    reconcile(counted)
    reconcile(counted, outcome=metrics.INVALID_SPEC)
    with pytest.raises(kopf.TemporaryError):
        reconcile(counted, raises=kopf.TemporaryError("blocked by a foreign object", delay=30))
    with pytest.raises(errors.KubeError):
        reconcile(counted, raises=errors.KubeError("patch", "StatefulSet ml/digits-ps", 403, "Forbidden"))
    assert value(counted, "distbelief_operator_reconciles_total", outcome="applied") == 2
    assert value(counted, "distbelief_operator_reconciles_total", outcome="invalid_spec") == 1
    assert value(counted, "distbelief_operator_reconciles_total", outcome="blocked") == 1
    assert value(counted, "distbelief_operator_reconciles_total", outcome="error") == 1
    assert value(counted, "distbelief_operator_reconcile_seconds_count") == 5
    # A refusal for now is no error; an exception is the reconcile handler's error.
    assert value(counted, "distbelief_operator_errors_total", handler="reconcile") == 1


def test_a_status_pass_that_raises_is_an_error_of_the_status_handler(counted: metrics.OperatorMetrics) -> None:
    with counted.counting_errors("status"):
        pass
    for failure in (errors.KubeError("get", "StatefulSet ml/digits-ps", 500, "Internal Server Error"),
                    kopf.TemporaryError("cannot scale the finished job down")):
        with pytest.raises(type(failure)), counted.counting_errors("status"):
            raise failure
    assert value(counted, "distbelief_operator_errors_total", handler="status") == 2
    assert value(counted, "distbelief_operator_errors_total", handler="reconcile") == 0


def test_jobs_are_counted_by_their_latest_phase_until_deleted(counted: metrics.OperatorMetrics) -> None:
    counted.phases.set("ml", "digits", "Pending")
    counted.phases.set("ml", "clicks", "Pending")
    counted.phases.set("research", "digits", "Running")
    counted.phases.set("ml", "digits", "Running")
    assert value(counted, "distbelief_operator_jobs", phase="Pending") == 1
    assert value(counted, "distbelief_operator_jobs", phase="Running") == 2
    assert value(counted, "distbelief_operator_jobs", phase="Succeeded") == 0
    assert value(counted, "distbelief_operator_job_phase", namespace="ml", distbelief_io_job="digits",
                 phase="Running") == 1
    assert value(counted, "distbelief_operator_job_phase", namespace="ml", distbelief_io_job="digits",
                 phase="Pending") is None
    counted.phases.forget("ml", "digits")
    counted.phases.forget("ml", "never-seen")
    assert value(counted, "distbelief_operator_jobs", phase="Running") == 1
    assert value(counted, "distbelief_operator_job_phase", namespace="ml", distbelief_io_job="digits",
                 phase="Running") is None


def test_a_deleted_job_leaves_the_operators_metrics() -> None:
    """The handler kopf calls for every event of a job forgets it on DELETED only."""
    metrics.OPERATOR.phases.set("unit-test", "gone", "Running")
    metrics.forget_deleted(type="MODIFIED", namespace="unit-test", name="gone")
    labels = {"namespace": "unit-test", "distbelief_io_job": "gone", "phase": "Running"}
    assert value(metrics.OPERATOR, "distbelief_operator_job_phase", **labels) == 1
    metrics.forget_deleted(type="DELETED", namespace="unit-test", name="gone")
    assert value(metrics.OPERATOR, "distbelief_operator_job_phase", **labels) is None
