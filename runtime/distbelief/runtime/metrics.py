"""Prometheus metrics of a role, served with its health endpoints.

Each role owns a registry (not the process-global one) so several roles can live in
one test process. The HTTP endpoint answers /metrics, /healthz (the process runs) and
/readyz (the role is serving: a shard has restored its state, a replica has joined).
"""

from __future__ import annotations

import http.server
import logging
import threading
import time
from collections import deque
from typing import Callable

import prometheus_client as prom

from distbelief.runtime import contract

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


class ShardMetrics:
    def __init__(self, registry: prom.CollectorRegistry, shard: int) -> None:
        labels = {"shard": str(shard)}

        def gauge(name: str, doc: str) -> prom.Gauge:
            return prom.Gauge(f"distbelief_{name}", doc, list(labels), registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> prom.Counter:
            return prom.Counter(f"distbelief_{name}", doc, list(labels), registry=registry).labels(**labels)

        self.global_step = gauge("global_step", "Updates this shard has applied over the job's life")
        self.train_loss = gauge("train_loss", "Moving average of the minibatch loss replicas report")
        self.examples_per_second = gauge("examples_per_second", "Examples per second behind the applied updates")
        self.examples = counter("examples", "Examples behind the applied updates")
        self.bytes_in = counter("bytes_in", "Bytes received")
        self.bytes_out = counter("bytes_out", "Bytes sent")
        self.rejected = counter("rejected_messages", "Messages refused as malformed or foreign")
        self.clipped = counter("clipped_updates", "Pushed gradients scaled down to maxGradientNorm")
        self.non_finite = counter("non_finite_states", "Times the state held a non-finite value and was restored")
        self.restarts = gauge("restarts", "Times this shard restarted from a checkpoint")
        self.checkpoint_step = gauge("checkpoint_step", "Step of the newest checkpoint")
        self.checkpoint_time = gauge("checkpoint_timestamp_seconds", "When the newest checkpoint was written")
        self.done = gauge("job_done", "1 once the job has finished")
        self.staleness = prom.Histogram(
            "distbelief_staleness_updates", "Updates applied between a replica's pull and its push",
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
        self.loss = prom.Gauge("distbelief_heldout_loss", "Held-out loss of the current parameters", registry=registry)
        self.accuracy = prom.Gauge("distbelief_heldout_accuracy", "Held-out accuracy of the current parameters", registry=registry)
        self.auc = prom.Gauge("distbelief_heldout_auc", "Held-out ROC AUC (two-class jobs; NaN otherwise)",
                              registry=registry)
        self.auc.set(float("nan"))
        self.evaluated_step = prom.Gauge("distbelief_evaluated_step", "Global step of the last evaluation", registry=registry)
        self.finished = prom.Gauge("distbelief_job_finished", "1 once the chief has ended the job",
                                   ["reason", "outcome"], registry=registry)


class CoordinatorMetrics:
    """Figures of the Sandblaster coordinator (beside shard 0)."""

    def __init__(self, registry: prom.CollectorRegistry) -> None:
        def gauge(name: str, doc: str) -> prom.Gauge:
            return prom.Gauge(f"distbelief_sandblaster_{name}", doc, registry=registry)

        def counter(name: str, doc: str) -> prom.Counter:
            return prom.Counter(f"distbelief_sandblaster_{name}", doc, registry=registry)

        self.iteration = gauge("iteration", "L-BFGS iterations committed")
        self.objective = gauge("objective", "Training objective at the committed parameters")
        self.gradient_norm = gauge("gradient_norm", "Norm of the gradient at the committed parameters")
        self.evaluations = counter("evaluations", "Objective and gradient evaluations over the whole batch")
        self.units = counter("units", "Work units handed out, backup copies included")
        self.backups = counter("backup_units", "Backup copies of unfinished work units handed out")
        self.duplicates = counter("duplicate_results", "Results dropped because another copy finished first")
        self.recoveries = counter("recoveries", "Rollbacks to a committed iteration after a shard restarted")
        self.evaluation_seconds = prom.Histogram("distbelief_sandblaster_evaluation_seconds",
                                                 "Time to evaluate the objective over the whole batch",
                                                 buckets=LATENCY_BUCKETS, registry=registry)


class WorkerMetrics:
    def __init__(self, registry: prom.CollectorRegistry) -> None:
        self.steps = prom.Counter("distbelief_worker_steps", "Minibatches this replica has computed", registry=registry)
        self.examples = prom.Counter("distbelief_worker_examples", "Examples this replica has trained on", registry=registry)
        self.loss = prom.Gauge("distbelief_worker_loss", "Loss of this replica's last minibatch", registry=registry)
        self.pull_seconds = prom.Histogram("distbelief_pull_seconds", "Time to pull the parameters from all shards",
                                           buckets=LATENCY_BUCKETS, registry=registry)
        self.push_seconds = prom.Histogram("distbelief_push_seconds",
                                           "Time to push a gradient to all shards (and get the parameters back, "
                                           "when the push fetches too)", buckets=LATENCY_BUCKETS, registry=registry)
        self.staleness = prom.Histogram("distbelief_worker_staleness_updates",
                                        "Updates other replicas applied between this replica's pull and push",
                                        buckets=STALENESS_BUCKETS, registry=registry)
        self.bytes_in = prom.Counter("distbelief_worker_bytes_in", "Bytes received", registry=registry)
        self.bytes_out = prom.Counter("distbelief_worker_bytes_out", "Bytes sent", registry=registry)
        self.retries = prom.Counter("distbelief_worker_retries", "Requests repeated after a shard did not answer", registry=registry)


class MetricsServer:
    """/metrics, /healthz and /readyz on a port, in a daemon thread."""

    def __init__(self, registry: prom.CollectorRegistry, port: int, ready: Callable[[], bool],
                 host: str = "0.0.0.0") -> None:
        handler = _handler(registry, ready)
        self._server = http.server.ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)

    def start(self) -> "MetricsServer":
        self._thread.start()
        log.info("event=metrics_listening port=%d", self.port)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(registry: prom.CollectorRegistry, ready: Callable[[], bool]) -> type:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            path = self.path.split("?")[0]
            if path == "/metrics":
                self._send(200, prom.generate_latest(registry), prom.CONTENT_TYPE_LATEST)
            elif path == contract.HEALTH_PATH:
                self._send(200, b"ok\n", "text/plain")
            elif path == contract.READY_PATH:
                ok = ready()
                self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n", "text/plain")
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    return Handler
