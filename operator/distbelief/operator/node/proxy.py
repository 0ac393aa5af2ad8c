"""The agent's HTTP endpoint: pods by name for clients off the pod network, and their logs.

    GET /api/v1/namespaces/NS/pods/POD:PORT/proxy/PATH   GET http://<POD's IP>:PORT/PATH, answered
                                                        as the pod answers (the API server's pod
                                                        proxy path, which refuses loopback pod IPs)
    GET /containerLogs/NS/POD/CONTAINER                  the container's log (the kubelet's path)
    GET /healthz                                         ok

A process that cannot resolve cluster DNS names reaches pods through it, e.g. the
operator run off the cluster, with
DISTBELIEF_METRICS_URL=http://127.0.0.1:PORT/api/v1/namespaces/{namespace}/pods/{pod}:{port}/proxy/metrics.
It serves on loopback only, to this machine's users (as the pods themselves do).
"""

from __future__ import annotations

import glob
import http.client
import http.server
import logging
import os
import re
import threading

from distbelief.operator.node.addresses import PodNetwork

log = logging.getLogger(__name__)

TIMEOUT_SECONDS = 10.0
MAX_BODY_BYTES = 16 << 20
_POD_PROXY = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/:]+):(\d+)/proxy(/.*)?$")
_LOGS = re.compile(r"^/containerLogs/([^/]+)/([^/]+)/([^/?]+)$")


class Endpoint:
    """The HTTP server in a thread of its own; port is where it listens."""

    def __init__(self, network: PodNetwork, root: str, host: str = "127.0.0.1", port: int = 0) -> None:
        handler = type("Handler", (_Handler,), {"network": network, "root": root})
        self.server = http.server.ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="node-endpoint", daemon=True)

    def start(self) -> "Endpoint":
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    network: PodNetwork
    root: str
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: object) -> None:
        log.debug("event=endpoint_request " + format, *args)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)
        if path[0] == "/healthz":
            return self._answer(200, b"ok", "text/plain")
        found = _POD_PROXY.match(path[0])
        if found:
            namespace, pod, port, rest = found.groups()
            target = (rest or "/") + (f"?{path[1]}" if len(path) > 1 else "")
            return self._forward(self.network.ip(namespace, pod), int(port), target)
        found = _LOGS.match(path[0])
        if found:
            return self._logs(*found.groups())
        self._answer(404, b"not found", "text/plain")

    def _forward(self, ip: str, port: int, target: str) -> None:
        connection = http.client.HTTPConnection(ip, port, timeout=TIMEOUT_SECONDS)
        try:
            connection.request("GET", target)
            response = connection.getresponse()
            body = response.read(MAX_BODY_BYTES + 1)
        except OSError as exc:
            return self._answer(502, f"pod at {ip}:{port} did not answer: {exc}".encode(), "text/plain")
        finally:
            connection.close()
        if len(body) > MAX_BODY_BYTES:
            return self._answer(502, b"answer too large", "text/plain")
        self._answer(response.status, body, response.getheader("Content-Type") or "text/plain")

    def _logs(self, namespace: str, pod: str, container: str) -> None:
        folders = glob.glob(os.path.join(glob.escape(self.root), "logs", glob.escape(f"{namespace}_{pod}_") + "*"))
        logs = [os.path.join(f, f"{container}.log") for f in folders if os.path.exists(os.path.join(f, f"{container}.log"))]
        if not logs:
            return self._answer(404, f"no log of {namespace}/{pod}/{container}".encode(), "text/plain")
        with open(max(logs, key=os.path.getmtime), "rb") as f:
            self._answer(200, f.read(), "text/plain")

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
