"""The roles' metrics server stays bounded under idle, slow and oversized clients (issue 18)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Iterator

import prometheus_client as prom
import pytest

from distbelief.runtime.observe.httpserver import BoundedHTTPServer, Response
from distbelief.runtime.observe.metrics import MetricsServer


@pytest.fixture
def metrics() -> Iterator[MetricsServer]:
    registry = prom.CollectorRegistry()
    prom.Gauge("distbelief_global_step", "step", registry=registry).set(7)
    server = MetricsServer(registry, 0, ready=lambda: False, host="127.0.0.1").start()
    yield server
    server.stop()


def get(port: int, path: str, timeout: float = 3.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def test_routes(metrics: MetricsServer) -> None:
    status, body = get(metrics.port, "/metrics")
    assert status == 200 and b"distbelief_global_step 7.0" in body
    assert get(metrics.port, "/healthz") == (200, b"ok\n")
    assert get(metrics.port, "/readyz?x=1") == (503, b"not ready\n")
    assert get(metrics.port, "/nope")[0] == 404
    with socket.create_connection(("127.0.0.1", metrics.port), timeout=3) as s:
        s.sendall(b"POST /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.0 405")


def test_idle_flood_keeps_healthz_answering_with_bounded_threads(metrics: MetricsServer) -> None:
    get(metrics.port, "/healthz")            # the pool's threads exist before the baseline
    threads_before = threading.active_count()
    with contextlib.ExitStack() as stack:
        idle = [stack.enter_context(socket.create_connection(("127.0.0.1", metrics.port), timeout=3))
                for _ in range(300)]
        for _ in range(3):
            assert get(metrics.port, "/healthz") == (200, b"ok\n")
        # A thread per connection would add 300; a few may come and go elsewhere in the process.
        assert threading.active_count() <= threads_before + 3
        # The server keeps at most 64 sockets: it closed the oldest idle ones for newcomers.
        assert sum(closed_by_peer(s) for s in idle) >= 300 - 64


# Run in a process of its own (as a flood comes from elsewhere): opens connections that
# send nothing until killed, at most 15 s, at most 200 held open at once; says so once 300
# were opened. In the server's process, its threads would take the GIL from the probes.
FLOOD = """
import contextlib, socket, sys, time
port, held, opened = int(sys.argv[1]), [], 0
give_up = time.monotonic() + 15
while time.monotonic() < give_up:
    with contextlib.suppress(OSError):
        held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
        opened += 1
        if opened == 300:
            print("flooding", flush=True)
    if len(held) > 200:
        held.pop(0).close()
"""


def test_healthz_answers_while_a_flood_of_connections_goes_on(metrics: MetricsServer) -> None:
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(metrics.port)], stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout is not None and flood.stdout.readline() == "flooding\n"
        for _ in range(5):
            assert get(metrics.port, "/healthz") == (200, b"ok\n")
        assert flood.poll() is None, "the flood ended before the probes: nothing was shown"
    finally:
        flood.kill()
        flood.wait(timeout=10)


def test_slowloris_is_cut_off_at_the_request_deadline() -> None:
    server = BoundedHTTPServer(lambda path: Response(200, b"ok"), "127.0.0.1", 0,
                               request_timeout=1.0).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=3) as s:
            started = time.monotonic()
            s.sendall(b"GET /healthz HTTP/1.1\r\n")
            cut_off = False
            for i in range(50):                  # one header line every 0.1 s: never complete
                try:
                    s.sendall(b"X-%d: y\r\n" % i)
                except ConnectionError:
                    cut_off = True
                    break
                if closed_by_peer(s):
                    cut_off = True
                    break
                s.setblocking(True)
                time.sleep(0.1)
            assert cut_off
            assert time.monotonic() - started < 1.0 + 1.5
        assert get(server.port, "/healthz") == (200, b"ok")
    finally:
        server.stop()


def test_oversized_head_is_dropped_unanswered() -> None:
    server = BoundedHTTPServer(lambda path: Response(200, b"ok"), "127.0.0.1", 0).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=3) as s:
            s.sendall(b"GET /" + b"a" * 20000)
            s.settimeout(3)
            with contextlib.suppress(ConnectionError):
                assert s.recv(100) == b""
    finally:
        server.stop()


def test_a_failing_route_keeps_the_server_serving() -> None:
    def route(path: str) -> Response:
        if path == "/boom":
            raise RuntimeError("boom")
        return Response(200, b"ok")

    server = BoundedHTTPServer(route, "127.0.0.1", 0, workers=1).start()
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port), timeout=3) as s:
                s.sendall(b"GET /boom HTTP/1.0\r\n\r\n")
                s.recv(100)
        assert get(server.port, "/x") == (200, b"ok")
    finally:
        server.stop()
