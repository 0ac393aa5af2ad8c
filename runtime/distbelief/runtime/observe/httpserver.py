"""A small HTTP/1.0 GET server whose threads, sockets and time per request are bounded.

One selector thread accepts connections and reads request heads without blocking, so an
idle or trickling client costs a socket, never a thread. A head complete within
`request_timeout` of the accept goes to a fixed pool of workers that answer and close.
At `max_connections` open sockets, the oldest connection still sending its head is
dropped for the newcomer: a probe sends its request at once and gets through a flood of
idle connections, while the flood keeps closing itself.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import selectors
import socket
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192
ACCEPT_BATCH = 16
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            503: "Service Unavailable"}


@dataclasses.dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain"


Route = Callable[[str], Response]   # path (without the query) -> response


@dataclasses.dataclass
class _Pending:
    sock: socket.socket
    deadline: float
    head: bytearray = dataclasses.field(default_factory=bytearray)


class BoundedHTTPServer:
    """Serves route(path) for GET and HEAD on (host, port) until stop()."""

    def __init__(self, route: Route, host: str, port: int, *, max_connections: int = 64,
                 workers: int = 4, request_timeout: float = 5.0) -> None:
        self._route = route
        self._max_connections = max_connections
        self._timeout = request_timeout
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._pending: collections.OrderedDict[int, _Pending] = collections.OrderedDict()
        self._answering = 0            # connections handed to the pool, not yet closed
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="http")
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="http-accept", daemon=True)

    def start(self) -> "BoundedHTTPServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=self._timeout + 1)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                for key, _ in self._selector.select(timeout=self._next_wait()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif (conn := self._pending.get(key.fd)) is not None:
                        self._read(conn)   # absent when evicted earlier in this batch
                self._expire()
        finally:
            for fd in list(self._pending):
                self._drop(fd)
            self._selector.close()
            self._listener.close()

    def _next_wait(self) -> float:
        # Wake for the earliest deadline; at most every 0.5 s to notice stop().
        if not self._pending:
            return 0.5
        first = next(iter(self._pending.values()))
        return max(0.0, min(0.5, first.deadline - time.monotonic()))

    def _accept(self) -> None:
        # A bounded batch: a connect flood must not keep the loop from reading the
        # requests (a probe's among them) that have already arrived.
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            with self._lock:
                answering = self._answering
            if answering >= self._max_connections:
                sock.close()   # every slot is answering a complete request: shed the newcomer
                continue
            if self._pending and len(self._pending) + answering >= self._max_connections:
                log.debug("event=http_connection_evicted reason=max_connections")
                self._drop(next(iter(self._pending)))
            sock.setblocking(False)
            self._pending[sock.fileno()] = _Pending(sock, time.monotonic() + self._timeout)
            self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, conn: _Pending) -> None:
        try:
            chunk = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        conn.head += chunk
        if not chunk or len(conn.head) > MAX_HEAD_BYTES:
            self._drop(conn.sock.fileno())
        elif b"\r\n\r\n" in conn.head or b"\n\n" in conn.head:
            self._selector.unregister(conn.sock)
            del self._pending[conn.sock.fileno()]
            with self._lock:
                self._answering += 1
            self._pool.submit(self._answer, conn)

    def _expire(self) -> None:
        # Pending connections sit in accept order, so the expired ones come first.
        now = time.monotonic()
        while self._pending:
            fd, conn = next(iter(self._pending.items()))
            if conn.deadline > now:
                return
            log.debug("event=http_connection_timed_out")
            self._drop(fd)

    def _drop(self, fd: int) -> None:
        conn = self._pending.pop(fd)
        self._selector.unregister(conn.sock)
        conn.sock.close()

    def _answer(self, conn: _Pending) -> None:
        try:
            method, path = _request_line(bytes(conn.head))
            if method in ("GET", "HEAD"):
                response = self._route(path)
            else:
                response = Response(405 if method else 400, b"")
            payload = _encode(response, with_body=method != "HEAD")
            conn.sock.settimeout(self._timeout)   # sendall: a total bound, not per send
            conn.sock.sendall(payload)
        except OSError as exc:
            log.debug("event=http_send_failed error=%s", exc)
        except Exception:  # a failing route must not take a worker with it
            log.exception("event=http_route_failed")
        finally:
            conn.sock.close()
            with self._lock:
                self._answering -= 1


def _request_line(head: bytes) -> tuple[str, str]:
    """(method, path without query) of a request head; ("", "") when malformed."""
    parts = head.split(b"\n", 1)[0].decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return "", ""
    return parts[0], parts[1].split("?", 1)[0]


def _encode(response: Response, *, with_body: bool) -> bytes:
    head = (f"HTTP/1.0 {response.status} {_REASONS.get(response.status, '')}\r\n"
            f"Content-Type: {response.content_type}\r\n"
            f"Content-Length: {len(response.body)}\r\n"
            "Connection: close\r\n\r\n").encode("latin-1")
    return head + response.body if with_body else head
