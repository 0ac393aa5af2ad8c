"""Stand-ins for the jobs' chiefs: shard 0's /metrics, served from this process.

There is no kubelet in the tests' control plane, so no shard pod ever runs. The operator
reads a job's training figures from the URL DISTBELIEF_METRICS_URL names; pointed at
`Chiefs.url`, it reads what a test sets on the runtime's own metric classes:

    chiefs = Chiefs()
    shard, chief = chiefs.of("ns", "job")     # ShardMetrics, ChiefMetrics of that job
    shard.global_step.set(1234)
"""

from __future__ import annotations

import http.server
import threading

import prometheus_client as prom

from distbelief.runtime.observe.metrics import ChiefMetrics, ShardMetrics


class Chiefs:
    """Shard 0's /metrics of every job at /<namespace>/<job>/metrics (404 for a job none was made for)."""

    def __init__(self) -> None:
        self.registries: dict[tuple[str, str], prom.CollectorRegistry] = {}
        self.metrics: dict[tuple[str, str], tuple[ShardMetrics, ChiefMetrics]] = {}
        chiefs = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                registry = chiefs.registries.get((parts[0], parts[1])) if len(parts) == 3 else None
                body = prom.generate_latest(registry) if registry else b""
                self.send_response(200 if registry else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/{{namespace}}/{{job}}/metrics"

    def of(self, namespace: str, job: str) -> tuple[ShardMetrics, ChiefMetrics]:
        key = (namespace, job)
        if key not in self.metrics:
            registry = prom.CollectorRegistry()
            self.registries[key] = registry
            self.metrics[key] = (ShardMetrics(registry, 0), ChiefMetrics(registry))
        return self.metrics[key]

    def stop(self) -> None:
        self.server.shutdown()
