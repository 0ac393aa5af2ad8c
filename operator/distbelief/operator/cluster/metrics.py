"""The operator's own Prometheus metrics, served on a port of its own when asked
(`distbelief operator --metrics [HOST:]PORT`).

    distbelief_operator_reconciles_total{outcome}      reconcile() calls: applied, blocked
                                                       (refused for now, retried), invalid_spec, error
    distbelief_operator_errors_total{handler}          handler calls that raised: reconcile, status
    distbelief_operator_reconcile_seconds              reconcile()'s time, a histogram
    distbelief_operator_jobs{phase}                    jobs in each phase, as the last status pass saw them
    distbelief_operator_job_phase{namespace, distbelief_io_job, phase}   1 for each job's phase

The per-job series carry the job's name under the label the jobs' own series get from
the chart's monitors (distbelief_io_job), so the two can be joined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Iterator

import kopf
import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from distbelief.operator import errors
from distbelief.operator.cluster import kube
from distbelief.operator.status.status import PENDING, RUNNING, SUSPENDED
from distbelief.runtime import contract

APPLIED, BLOCKED, INVALID_SPEC, ERROR = "applied", "blocked", "invalid_spec", "error"
PHASES = (PENDING, RUNNING, SUSPENDED, contract.SUCCEEDED, contract.FAILED)
RECONCILE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
JOB_LABEL = "distbelief_io_job"


@dataclasses.dataclass
class Attempt:
    outcome: str = APPLIED


class JobPhases(Collector):
    """Each job's phase as the last status pass computed it, read at each scrape."""

    def __init__(self) -> None:
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def set(self, namespace: str, name: str, phase: str) -> None:
        with self._lock:
            self._phases[namespace, name] = phase

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._phases.pop((namespace, name), None)

    def collect(self):  # type: ignore[no-untyped-def]
        with self._lock:
            phases = dict(self._phases)
        counts = GaugeMetricFamily("distbelief_operator_jobs", "Jobs in each phase", labels=["phase"])
        for phase in sorted({*PHASES, *phases.values()}):
            counts.add_metric([phase], sum(seen == phase for seen in phases.values()))
        yield counts
        each = GaugeMetricFamily("distbelief_operator_job_phase", "1 for each job's current phase",
                                 labels=["namespace", JOB_LABEL, "phase"])
        for (namespace, name), phase in sorted(phases.items()):
            each.add_metric([namespace, name, phase], 1)
        yield each


class ApiRequests(Collector):
    """The requests the operator's own API client sent, by method and resource, read at each
    scrape. A status pass sends none (it reads the operator's watches): a rate that grows
    with the jobs while nothing changes says a handler reads what it should watch."""

    def collect(self):  # type: ignore[no-untyped-def]
        family = CounterMetricFamily("distbelief_operator_api_requests",
                                     "Requests the operator's own client sent to the API server (kopf's watches "
                                     "and status patches aside), by method and resource",
                                     labels=["method", "resource"])
        for (method, resource), count in sorted(kube.requests_sent().items()):
            family.add_metric([method, resource], count)
        yield family


class OperatorMetrics:
    def __init__(self, registry: prom.CollectorRegistry) -> None:
        self.registry = registry
        self.reconciles = prom.Counter("distbelief_operator_reconciles", "reconcile() calls, by outcome",
                                       ["outcome"], registry=registry)
        self.errors = prom.Counter("distbelief_operator_errors", "Handler calls that raised, by handler",
                                   ["handler"], registry=registry)
        self.reconcile_seconds = prom.Histogram("distbelief_operator_reconcile_seconds", "Time of one reconcile()",
                                                buckets=RECONCILE_BUCKETS, registry=registry)
        for outcome in (APPLIED, BLOCKED, INVALID_SPEC, ERROR):
            self.reconciles.labels(outcome)   # every outcome shows from the start, at 0
        for handler in ("reconcile", "status"):
            self.errors.labels(handler)
        self.phases = JobPhases()
        registry.register(self.phases)
        registry.register(ApiRequests())

    @contextlib.contextmanager
    def reconciling(self) -> Iterator[Attempt]:
        """Time and count one reconcile(): its outcome is what the block sets, `blocked` when
        it raises kopf's TemporaryError (a refusal for now: kopf calls it again later),
        `error` (and an error) for any other exception."""
        attempt, started = Attempt(), time.monotonic()
        try:
            yield attempt
        except kopf.TemporaryError:
            attempt.outcome = BLOCKED
            raise
        except Exception:
            attempt.outcome = ERROR
            self.errors.labels("reconcile").inc()
            raise
        finally:
            self.reconcile_seconds.observe(time.monotonic() - started)
            self.reconciles.labels(attempt.outcome).inc()

    @contextlib.contextmanager
    def counting_errors(self, handler: str) -> Iterator[None]:
        """Count each exception of the block as an error of the handler."""
        try:
            yield
        except Exception:
            self.errors.labels(handler).inc()
            raise


def new_registry() -> prom.CollectorRegistry:
    """The operator's registry, with the process's own figures (memory, CPU, open files)."""
    registry = prom.CollectorRegistry()
    prom.ProcessCollector(registry=registry)
    return registry


OPERATOR = OperatorMetrics(new_registry())


@kopf.on.event(contract.API_GROUP, contract.API_VERSION, contract.PLURAL)
def forget_deleted(type: str | None, namespace: str, name: str, **_: Any) -> None:
    """A deleted job leaves the per-job series (each status pass sets its job's)."""
    if type == "DELETED":
        OPERATOR.phases.forget(namespace, name)


def serve(host: str, port: int) -> None:
    """Serve OPERATOR's metrics on host:port from a thread of their own (every path answers
    the metrics, as prometheus_client's server does)."""
    try:
        prom.start_http_server(port, addr=host, registry=OPERATOR.registry)
    except OSError as exc:
        raise errors.OperatorError(f"cannot serve the operator's metrics on {host}:{port} "
                                   f"(--metrics): {exc.strerror or exc}") from exc
