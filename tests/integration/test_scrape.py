"""The operator's scrape of the chief's /metrics is bounded in time and size (issue 18).

The servers here stand in for a hostile shard-0 image: one trickles, one sends too much.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable, Iterator

import pytest

from distbelief.operator import errors
from distbelief.operator.status import scrape

METRICS = b"# TYPE distbelief_global_step gauge\ndistbelief_global_step 42.0\n"


class Server:
    """Answers one connection at a time with behave(conn); counts the bytes it got out."""

    def __init__(self, behave: Callable[[socket.socket, "Server"], None]) -> None:
        self.behave = behave
        self.sent = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/metrics"
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(4096)
                try:
                    self.behave(conn, self)
                except OSError:
                    pass   # the client gave up: what these tests want

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.listener.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket, Server], None]], Server]]:
    servers: list[Server] = []

    def start(behave: Callable[[socket.socket, Server], None]) -> Server:
        servers.append(Server(behave))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def honest(conn: socket.socket, server: Server) -> None:
    server.send(conn, b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(METRICS) + METRICS)


def trickle(conn: socket.socket, server: Server) -> None:
    # One byte every 0.1 s: each read succeeds long before a per-read timeout would fire.
    for byte in b"HTTP/1.0 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 1000:
        if server.stopping.is_set():
            return
        server.send(conn, bytes([byte]))
        time.sleep(0.1)


def huge(declare: bool) -> Callable[[socket.socket, Server], None]:
    def behave(conn: socket.socket, server: Server) -> None:
        total = 64 << 20
        length = b"Content-Length: %d\r\n" % total if declare else b""
        server.send(conn, b"HTTP/1.0 200 OK\r\n" + length + b"\r\n")
        chunk = b"# " + b"x" * 65534
        for _ in range(total // len(chunk)):
            server.send(conn, chunk)
    return behave


def test_an_honest_endpoint_is_read(serve) -> None:
    assert scrape.read(serve(honest).url).global_step == 42


def test_a_trickling_server_is_abandoned_at_the_total_deadline(serve) -> None:
    server = serve(trickle)
    started = time.monotonic()
    with pytest.raises(errors.ScrapeError, match="deadline"):
        scrape.fetch(server.url, timeout=1.0)
    assert time.monotonic() - started < 1.0 + 1.0
    assert 0 < server.sent < 100          # it was still trickling when the client left
    assert not scrape.read(server.url, timeout=1.0).reachable


def test_a_declared_oversized_body_is_refused_unread(serve) -> None:
    server = serve(huge(declare=True))
    with pytest.raises(errors.ScrapeError, match="declared body"):
        scrape.fetch(server.url)
    time.sleep(0.2)
    assert server.sent < 32 << 20     # refused on the head, not after 64 MB


def test_an_undeclared_oversized_body_is_cut_at_the_cap(serve) -> None:
    server = serve(huge(declare=False))
    with pytest.raises(errors.ScrapeError, match="larger than"):
        scrape.fetch(server.url, max_bytes=1 << 20)
    time.sleep(0.2)
    # The server got out only what fits in the cap and the socket buffers, not its 64 MB.
    assert server.sent < 32 << 20


def test_an_error_status_gives_empty_figures(serve) -> None:
    server = serve(lambda conn, s: s.send(conn, b"HTTP/1.0 503 Service Unavailable\r\n\r\n"))
    assert not scrape.read(server.url).reachable


def test_a_body_cut_short_gives_empty_figures_not_half_of_them(serve) -> None:
    """A pod that dies mid-answer (a killed shard 0) must read as unreachable."""
    def dies(conn: socket.socket, server: Server) -> None:
        server.send(conn, b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(METRICS) + METRICS[:20])

    server = serve(dies)
    with pytest.raises(errors.ScrapeError, match="cut short"):
        scrape.fetch(server.url)
    assert not scrape.read(server.url).reachable


def test_every_metric_the_operator_reads_is_one_a_role_exports() -> None:
    import prometheus_client as prom

    from distbelief.runtime import contract
    from distbelief.runtime.observe.metrics import (
        ChiefMetrics, CoordinatorMetrics, DispenserMetrics, ShardMetrics, TrafficCollector, WorkerMetrics)

    registry = prom.CollectorRegistry()
    ShardMetrics(registry, 0), ChiefMetrics(registry), CoordinatorMetrics(registry)
    DispenserMetrics(registry, lambda: 0.0)
    registry.register(TrafficCollector())
    WorkerMetrics(worker := prom.CollectorRegistry())
    exported = {family.name for r in (registry, worker) for family in r.collect()}
    read = {value for name, value in vars(contract.Metric).items() if name.isupper()}
    assert read <= exported, f"read but never exported: {sorted(read - exported)}"
