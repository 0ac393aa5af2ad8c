"""Prometheus metrics of a role, served with its health endpoints.

Each role owns a registry (not the process-global one) so several roles can live in
one test process. The HTTP endpoint answers /metrics, /healthz (the process runs) and
/readyz (the role is serving: a shard has restored its state, a replica has joined).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from distbelief.runtime import contract
from distbelief.runtime.contract import Metric as M
from distbelief.runtime.observe.httpserver import BoundedHTTPServer, Response, Route
from distbelief.runtime.observe.traffic import PROCESS_TRAFFIC, Traffic

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


class ShardMetrics:
    def __init__(self, registry: prom.CollectorRegistry, shard: int) -> None:
        labels = {"shard": str(shard)}

        def gauge(name: str, doc: str) -> prom.Gauge:
            return prom.Gauge(name, doc, list(labels), registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> prom.Counter:
            return prom.Counter(name, doc, list(labels), registry=registry).labels(**labels)

        self.global_step = gauge(M.GLOBAL_STEP, "Updates this shard has applied over the job's life")
        self.updates_lost = gauge("distbelief_shard_updates_lost",
                                  "Applied updates this shard lost (a restore or takeover behind what replicas pulled)")
        self.train_loss = gauge(M.TRAIN_LOSS, "Moving average of the minibatch loss replicas report")
        self.examples_per_second = gauge(M.EXAMPLES_PER_SECOND, "Examples per second behind the applied updates")
        self.examples = counter("distbelief_examples", "Examples behind the applied updates")
        self.bytes_in = counter("distbelief_bytes_in", "Bytes received")
        self.bytes_out = counter("distbelief_bytes_out", "Bytes sent")
        self.rejected = counter("distbelief_rejected_messages", "Messages refused as malformed or foreign")
        self.clipped = counter("distbelief_clipped_updates", "Pushed gradients scaled down to maxGradientNorm")
        self.stale = counter("distbelief_stale_pushes", "Pushes not applied: older than maxStaleness updates")
        self.staleness_max = gauge(M.STALENESS_MAX, "Largest staleness of an applied update")
        self.non_finite = counter("distbelief_non_finite_states", "Times the state held a non-finite value and was restored")
        self.rows = gauge(M.ROWS, "Embedding rows this shard holds")
        self.row_budget = gauge(M.ROW_BUDGET, "The most embedding rows this shard may hold (0: no budget)")
        self.rows_refused = counter(M.ROWS_REFUSED, "Embedding rows not created for want of room in the budget")
        self.rows_evicted = counter(M.ROWS_EVICTED, "Embedding rows evicted to make room in the budget")
        self.restarts = gauge("distbelief_restarts", "Times this shard restarted from a checkpoint")
        self.checkpoint_step = gauge(M.CHECKPOINT_STEP, "Step of the newest checkpoint")
        self.checkpoint_time = gauge(M.CHECKPOINT_TIME, "When the newest checkpoint was written")
        self.done = gauge("distbelief_job_done", "1 once the job has finished")
        self.copy_role = gauge("distbelief_copy_role", "This shard copy's role: 0 catching up, 1 backup, 2 primary")
        self.copy_view = gauge("distbelief_copy_view", "The view this shard copy is in (its residue: the primary's rank)")
        self.copies_in_sync = gauge("distbelief_copies_in_sync", "On a primary: copies every update reaches, itself included")
        self.failovers = gauge("distbelief_copy_failovers", "Times a backup of this shard took over from its primary")
        self.journal_bytes = counter("distbelief_journal_bytes", "Bytes of applied commands written to the shard's journal")
        self.journal_syncs = counter("distbelief_journal_syncs", "Flushes of the journal to disk (each releases waiting replies)")
        self.staleness = prom.Histogram(
            M.STALENESS, "Updates applied between a replica's pull and its push",
            list(labels), buckets=STALENESS_BUCKETS, registry=registry).labels(**labels)
        self._shard = str(shard)
        self._request_seconds = prom.Histogram(
            "distbelief_shard_request_seconds", "Time a shard spends on one request",
            ["shard", "op"], buckets=LATENCY_BUCKETS, registry=registry)
        self._by_op: dict[str, prom.Histogram] = {}

    def request_seconds(self, op: str) -> prom.Histogram:
        # One child per op, made on its first request: a label lookup per request would
        # sit in the hot path.
        child = self._by_op.get(op)
        if child is None:
            child = self._by_op[op] = self._request_seconds.labels(shard=self._shard, op=op)
        return child


class RateWindow:
    """Events per second over the last `seconds`, summed incrementally."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._window: deque[tuple[float, int]] = deque()
        self._sum = 0

    def add(self, count: int) -> float | None:
        """Count events now; the rate, once the window spans half a second."""
        now = time.monotonic()
        self._window.append((now, count))
        self._sum += count
        while self._window and now - self._window[0][0] > self.seconds:
            self._sum -= self._window.popleft()[1]
        span = now - self._window[0][0]
        return self._sum / span if span > 0.5 else None


class ChiefMetrics:
    """Figures the chief (shard 0) adds: held-out evaluation and the job's outcome."""

    def __init__(self, registry: prom.CollectorRegistry) -> None:
        self.loss = prom.Gauge(M.HELDOUT_LOSS, "Held-out loss of the current parameters", registry=registry)
        self.accuracy = prom.Gauge(M.HELDOUT_ACCURACY, "Held-out accuracy of the current parameters", registry=registry)
        self.auc = prom.Gauge(M.HELDOUT_AUC, "Held-out ROC AUC (two-class jobs; NaN otherwise)",
                              registry=registry)
        self.auc.set(float("nan"))
        self.evaluated_step = prom.Gauge("distbelief_evaluated_step", "Global step of the last evaluation", registry=registry)
        self.finished = prom.Gauge(M.JOB_FINISHED, "1 once the chief has ended the job",
                                   ["reason", "outcome"], registry=registry)
        self.degraded = prom.Gauge(M.MODEL_DEGRADED, "1 once the chief judged the ended job's model degraded",
                                   ["reason", "message"], registry=registry)
        # each shard's copies as its primary reports them (jobs with backups only)
        self.shard_copies = prom.Gauge(M.SHARD_COPIES, "Copies of the shard in sync, primary included", ["shard"],
                                       registry=registry)
        self.shard_primary = prom.Gauge(M.SHARD_PRIMARY, "Copy rank of the shard's primary", ["shard"], registry=registry)
        self.shard_failovers = prom.Gauge(M.SHARD_FAILOVERS, "Times a backup of the shard took over", ["shard"],
                                          registry=registry)
        # each shard's lost updates (shard/losses.py), as it reports them
        self.updates_lost = prom.Gauge(M.UPDATES_LOST, "Applied updates the shard lost", ["shard"], registry=registry)
        # every shard's embedding rows, as each reports them (jobs with embeddings only): max (the
        # fullest shard's), budget (a shard's; 0: none), refused and evicted (all shards')
        self.rows = prom.Gauge(M.JOB_ROWS, "The shards' embedding rows and their budget, by figure", ["figure"],
                               registry=registry)


class DispenserMetrics:
    """Figures of the data dispenser (beside shard 0, when the replicas stream a file source)."""

    def __init__(self, registry: prom.CollectorRegistry, epochs: Callable[[], float]) -> None:
        self.epoch = prom.Gauge(M.DATA_EPOCH, "Epochs of the training files the replicas finished",
                                registry=registry)
        self.epoch.set_function(epochs)


class CoordinatorMetrics:
    """Figures of the Sandblaster coordinator (beside shard 0)."""

    def __init__(self, registry: prom.CollectorRegistry) -> None:
        def gauge(name: str, doc: str) -> prom.Gauge:
            return prom.Gauge(name, doc, registry=registry)

        def counter(name: str, doc: str) -> prom.Counter:
            return prom.Counter(name, doc, registry=registry)

        self.iteration = gauge("distbelief_sandblaster_iteration", "L-BFGS iterations committed")
        self.objective = gauge(M.SANDBLASTER_OBJECTIVE, "Training objective at the committed parameters")
        self.gradient_norm = gauge("distbelief_sandblaster_gradient_norm",
                                   "Norm of the gradient at the committed parameters")
        self.evaluations = counter(M.SANDBLASTER_EVALUATIONS, "Objective and gradient evaluations over the whole batch")
        self.units = counter("distbelief_sandblaster_units", "Work units handed out, backup copies included")
        self.backups = counter("distbelief_sandblaster_backup_units",
                               "Backup copies of unfinished work units handed out")
        self.duplicates = counter("distbelief_sandblaster_duplicate_results",
                                  "Results dropped because another copy finished first")
        self.recoveries = counter("distbelief_sandblaster_recoveries",
                                  "Rollbacks to a committed iteration after a shard restarted")
        self.evaluation_seconds = prom.Histogram("distbelief_sandblaster_evaluation_seconds",
                                                 "Time to evaluate the objective over the whole batch",
                                                 buckets=LATENCY_BUCKETS, registry=registry)


class WorkerMetrics:
    def __init__(self, registry: prom.CollectorRegistry) -> None:
        self.steps = prom.Counter(M.WORKER_STEPS, "Minibatches this replica has computed", registry=registry)
        self.examples = prom.Counter(M.WORKER_EXAMPLES, "Examples this replica has trained on", registry=registry)
        self.loss = prom.Gauge(M.WORKER_LOSS, "Loss of this replica's last minibatch", registry=registry)
        self.pull_seconds = prom.Histogram("distbelief_pull_seconds", "Time to pull the parameters from all shards",
                                           buckets=LATENCY_BUCKETS, registry=registry)
        self.push_seconds = prom.Histogram("distbelief_push_seconds",
                                           "Time to push a gradient to all shards (and get the parameters back, "
                                           "when the push fetches too)", buckets=LATENCY_BUCKETS, registry=registry)
        self.staleness = prom.Histogram("distbelief_worker_staleness_updates",
                                        "Updates other replicas applied between this replica's pull and push",
                                        buckets=STALENESS_BUCKETS, registry=registry)
        self.stale = prom.Counter("distbelief_worker_stale_pushes",
                                  "Pushes a shard did not apply: computed from parameters older than maxStaleness",
                                  registry=registry)
        self.bytes_in = prom.Counter("distbelief_worker_bytes_in", "Bytes received", registry=registry)
        self.bytes_out = prom.Counter("distbelief_worker_bytes_out", "Bytes sent", registry=registry)
        self.retries = prom.Counter("distbelief_worker_retries", "Requests repeated after a shard did not answer",
                                    registry=registry)
        self.acknowledged = prom.Counter(M.WORKER_PUSHES_ACKNOWLEDGED, "Pushes a shard acknowledged as applied",
                                         ["shard"], registry=registry)


class TrafficCollector(Collector):
    """The process's transport traffic (traffic.PROCESS_TRAFFIC), read at each scrape: what
    the pod moved, whichever of its roles moved it."""

    def __init__(self, traffic: Traffic = PROCESS_TRAFFIC) -> None:
        self.traffic = traffic

    def collect(self):  # type: ignore[no-untyped-def]
        yield CounterMetricFamily(M.TRANSPORT_BYTES_IN, "Bytes this process received over the job's transport",
                                  value=self.traffic.bytes_in)
        yield CounterMetricFamily(M.TRANSPORT_BYTES_OUT, "Bytes this process sent over the job's transport",
                                  value=self.traffic.bytes_out)


class MetricsServer:
    """/metrics, /healthz and /readyz on a port, with bounded threads and connections.

    Probes decide whether the kubelet restarts the pod, so a flood of idle or slow
    connections must not starve them (httpserver says how).
    """

    def __init__(self, registry: prom.CollectorRegistry, port: int, ready: Callable[[], bool],
                 host: str = "0.0.0.0") -> None:
        self._server = BoundedHTTPServer(_routes(registry, ready), host, port)
        self.port = self._server.port

    def start(self) -> "MetricsServer":
        self._server.start()
        log.info("event=metrics_listening port=%d", self.port)
        return self

    def stop(self) -> None:
        self._server.stop()


def _routes(registry: prom.CollectorRegistry, ready: Callable[[], bool]) -> Route:
    def route(path: str) -> Response:
        if path == "/metrics":
            return Response(200, prom.generate_latest(registry), prom.CONTENT_TYPE_LATEST)
        if path == contract.HEALTH_PATH:
            return Response(200, b"ok\n")
        if path == contract.READY_PATH:
            ok = ready()
            return Response(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
        return Response(404, b"not found\n")

    return route
