"""Reading a job's training figures from the chief's Prometheus endpoint.

Local mode's progress bar and the operator's status both come from here, so they agree.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
import time
import urllib.parse

from prometheus_client.parser import text_string_to_metric_families

from distbelief.operator import errors
from distbelief.runtime.contract import Metric as M

log = logging.getLogger(__name__)

TIMEOUT_SECONDS = 2.0       # for the whole request: connect, send, every read
MAX_BODY_BYTES = 1 << 20    # a chief's /metrics is a few KB
MAX_HEAD_BYTES = 16384
# Every role's process, as prometheus_client's process collector names it (roles/common.py).
RESIDENT_MEMORY, CPU_SECONDS_TOTAL = "process_resident_memory_bytes", "process_cpu_seconds_total"


@dataclasses.dataclass(frozen=True)
class Figures:
    global_step: int | None = None
    loss: float | None = None
    train_loss: float | None = None         # shard 0's moving average of the replicas' minibatch losses
    accuracy: float | None = None
    auc: float | None = None                # two-class jobs only
    examples_per_second: float | None = None
    objective: float | None = None          # Sandblaster's, at the committed iteration
    epoch: float | None = None              # a streamed file source's epochs finished (the dispenser's)
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None
    finished_reason: str | None = None
    finished_outcome: str | None = None
    replica_steps: int | None = None        # a replica's: the minibatches it computed
    replica_examples: int | None = None     # a replica's: the examples it trained on
    staleness_max: int | None = None        # the largest staleness of an update shard 0 applied
    staleness_p50: float | None = None      # the median's bucket bound, from shard 0's histogram
    bytes_in: int | None = None             # what the pod's process received over the job's transport
    bytes_out: int | None = None            # ... and sent
    resident_memory: int | None = None      # the pod's process's resident memory, bytes
    cpu_seconds: float | None = None        # ... and its CPU time so far
    # with backups, each shard by index: {"copies": in sync, "primary": its copy rank, "failovers": n}
    copies: dict[int, dict[str, int]] | None = None
    degraded_reason: str | None = None      # the chief's verdict on the ended job's model (ModelDegraded)
    degraded_message: str | None = None
    rows_max: int | None = None             # with embeddings: the fullest shard's rows
    row_budget: int | None = None           # ... a shard's row budget (0: none)
    rows_refused: int | None = None         # ... rows the shards refused for want of room
    rows_evicted: int | None = None         # ... rows they evicted to make room
    updates_lost: dict[int, int] | None = None  # shard -> applied updates it lost, where any (shard/losses.py)

    @property
    def reachable(self) -> bool:
        return self.global_step is not None


def parse(text: str) -> Figures:
    values: dict[str, float] = {}
    finished: tuple[str, str] | None = None
    degraded: tuple[str, str] | None = None
    rows: dict[str, int] = {}
    staleness: list[tuple[float, float]] = []  # (bucket bound, updates at most that stale)
    copies: dict[int, dict[str, int]] = {}
    lost: dict[int, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == M.JOB_FINISHED and sample.value == 1:
                finished = (sample.labels.get("reason", ""), sample.labels.get("outcome", ""))
            elif sample.name == M.MODEL_DEGRADED and sample.value == 1:
                degraded = (sample.labels.get("reason", ""), sample.labels.get("message", ""))
            elif sample.name == M.JOB_ROWS:
                rows[sample.labels.get("figure", "")] = int(sample.value)
            elif sample.name == M.UPDATES_LOST and sample.labels.get("shard", "").isdigit():
                if sample.value > 0:
                    lost[int(sample.labels["shard"])] = int(sample.value)
            elif sample.name in _COPY_FIGURES and sample.labels.get("shard", "").isdigit():
                copies.setdefault(int(sample.labels["shard"]), {})[_COPY_FIGURES[sample.name]] = int(sample.value)
            elif sample.name == M.STALENESS + "_bucket":
                staleness.append((float(sample.labels["le"]), sample.value))
            else:
                values[sample.name] = sample.value

    def integer(name: str) -> int | None:
        return int(values[name]) if name in values else None

    return Figures(
        global_step=integer(M.GLOBAL_STEP),
        loss=values.get(M.HELDOUT_LOSS),
        train_loss=values.get(M.TRAIN_LOSS),
        accuracy=values.get(M.HELDOUT_ACCURACY),
        auc=_finite(values.get(M.HELDOUT_AUC)),
        examples_per_second=values.get(M.EXAMPLES_PER_SECOND),
        # The gauge exists from the coordinator's start; it means something after an evaluation.
        objective=values.get(M.SANDBLASTER_OBJECTIVE) if values.get(
            M.SANDBLASTER_EVALUATIONS + "_total") else None,
        epoch=values.get(M.DATA_EPOCH),
        checkpoint_step=integer(M.CHECKPOINT_STEP),
        staleness_max=integer(M.STALENESS_MAX),
        staleness_p50=_median_bound(staleness),
        checkpoint_time=values.get(M.CHECKPOINT_TIME) or None,
        finished_reason=finished[0] if finished else None,
        finished_outcome=finished[1] if finished else None,
        replica_steps=integer(M.WORKER_STEPS + "_total"),
        replica_examples=integer(M.WORKER_EXAMPLES + "_total"),
        bytes_in=integer(M.TRANSPORT_BYTES_IN + "_total"),
        bytes_out=integer(M.TRANSPORT_BYTES_OUT + "_total"),
        resident_memory=integer(RESIDENT_MEMORY),
        cpu_seconds=values.get(CPU_SECONDS_TOTAL),
        copies=copies or None,
        degraded_reason=degraded[0] if degraded else None,
        degraded_message=degraded[1] if degraded else None,
        rows_max=rows.get("max"),
        row_budget=rows.get("budget"),
        rows_refused=rows.get("refused"),
        rows_evicted=rows.get("evicted"),
        updates_lost=lost or None,
    )


_COPY_FIGURES = {M.SHARD_COPIES: "copies", M.SHARD_PRIMARY: "primary", M.SHARD_FAILOVERS: "failovers"}


def _median_bound(buckets: list[tuple[float, float]]) -> float | None:
    """The upper bound of the histogram bucket that holds the median; None before any update."""
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    return next(bound for bound, count in buckets if count >= total / 2)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def read(url: str, *, timeout: float = TIMEOUT_SECONDS) -> Figures:
    """The figures at url (a /metrics endpoint); empty Figures when it does not answer."""
    try:
        return parse(fetch(url, timeout=timeout).decode())
    except (OSError, errors.ScrapeError, ValueError) as exc:
        log.debug("event=scrape_failed url=%s error=%s", url, exc)
        return Figures()


def fetch(url: str, *, timeout: float = TIMEOUT_SECONDS, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The body of GET url over HTTP/1.0, all of it read within timeout seconds.

    The endpoint is shard 0's, which runs the job's image: any tenant's code. So a
    trickling answer is abandoned at the deadline, and a body declared or sent larger
    than max_bytes is refused as soon as that shows, without reading the rest.
    """
    deadline = time.monotonic() + timeout
    target = urllib.parse.urlsplit(url)
    path = (target.path or "/") + (f"?{target.query}" if target.query else "")
    try:
        with socket.create_connection((target.hostname or "", target.port or 80), timeout=timeout) as sock:
            _within(sock, deadline)
            sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {target.netloc}\r\n\r\n".encode("latin-1"))
            head, body = _read_head(sock, deadline)
            length = _check_head(head, max_bytes)
            _read_body(sock, deadline, body, length if length is not None else max_bytes + 1)
    except TimeoutError as exc:
        raise errors.ScrapeError("deadline passed") from exc
    if len(body) > max_bytes:
        raise errors.ScrapeError(f"body larger than {max_bytes} bytes")
    if length is not None and len(body) < length:  # the pod died mid-answer: half figures are no figures
        raise errors.ScrapeError(f"body cut short at {len(body)} of {length} bytes")
    return bytes(body[:length] if length is not None else body)


def _within(sock: socket.socket, deadline: float) -> None:
    """Let the next socket call block only until the request's deadline."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise errors.ScrapeError("deadline passed")
    sock.settimeout(remaining)


def _read_head(sock: socket.socket, deadline: float) -> tuple[bytes, bytearray]:
    """(status line and headers, the body bytes that came with them)."""
    received = bytearray()
    while (end := received.find(b"\r\n\r\n")) < 0:
        if len(received) > MAX_HEAD_BYTES:
            raise errors.ScrapeError("response head too large")
        _within(sock, deadline)
        chunk = sock.recv(4096)
        if not chunk:
            raise errors.ScrapeError("connection closed before the response head")
        received += chunk
    return bytes(received[:end]), received[end + 4:]


def _read_body(sock: socket.socket, deadline: float, body: bytearray, wanted: int) -> None:
    """Append to body until it holds wanted bytes or the server closes."""
    while len(body) < wanted:
        _within(sock, deadline)
        chunk = sock.recv(65536)
        if not chunk:
            return
        body += chunk


def _check_head(head: bytes, max_bytes: int) -> int | None:
    """The declared Content-Length, if any; errors.ScrapeError unless 200 and small enough."""
    status_line, *headers = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or parts[1] != "200":
        raise errors.ScrapeError(f"status {status_line[:80]!r}")
    for line in headers:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())   # ValueError: refused by read()
            if not 0 <= length <= max_bytes:
                raise errors.ScrapeError(f"declared body of {length} bytes, more than {max_bytes}")
            return length
    return None
