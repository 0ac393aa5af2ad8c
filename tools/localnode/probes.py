"""Readiness and liveness probes, run as a kubelet runs them: httpGet (any status from 200
to 399 passes), tcpSocket or exec, every periodSeconds after initialDelaySeconds, each
within timeoutSeconds; successThreshold passes in a row make a container ready (or
alive), failureThreshold failures in a row make it unready (or due for a restart).

The probes of every container share a small thread pool, so a slow probe holds no one
else's; a container's probe never overlaps its previous one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import logging
import socket
import subprocess
import threading
import time
from typing import Any, Mapping

log = logging.getLogger(__name__)

WORKERS = 8
Manifest = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a container's probes go: its pod's IP, its named ports, its environment."""

    ip: str
    ports: Mapping[str, int]
    env: Mapping[str, str]


@dataclasses.dataclass
class Probe:
    """One probe of one run of a container, and what it found so far."""

    spec: Manifest
    target: Target
    healthy: bool            # readiness starts unready, liveness alive
    started: float = dataclasses.field(default_factory=time.monotonic)
    due: float = 0.0
    passes: int = 0
    failures: int = 0
    running: bool = False

    def __post_init__(self) -> None:
        self.due = self.started + float(self.spec.get("initialDelaySeconds", 0))

    def record(self, passed: bool) -> None:
        if passed:
            self.passes, self.failures = self.passes + 1, 0
            if self.passes >= int(self.spec.get("successThreshold", 1)):
                self.healthy = True
        else:
            self.passes, self.failures = 0, self.failures + 1
            if self.failures >= int(self.spec.get("failureThreshold", 3)):
                self.healthy = False


class Prober:
    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="probe")
        self._lock = threading.Lock()

    def tick(self, probe: Probe | None) -> None:
        """Start the probe if it is due (and not still running)."""
        now = time.monotonic()
        with self._lock:
            if probe is None or probe.running or now < probe.due:
                return
            probe.running = True
            probe.due = now + float(probe.spec.get("periodSeconds", 10))
        self._pool.submit(self._run, probe)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, probe: Probe) -> None:
        try:
            passed = run_once(probe.spec, probe.target)
        except Exception as exc:  # a probe that cannot even be tried has failed
            log.debug("event=probe_error error=%s", exc)
            passed = False
        with self._lock:
            probe.record(passed)
            probe.running = False


def run_once(spec: Manifest, target: Target) -> bool:
    timeout = float(spec.get("timeoutSeconds", 1))
    if "httpGet" in spec:
        get = spec["httpGet"]
        connection = http.client.HTTPConnection(get.get("host") or target.ip, _port(get["port"], target),
                                                timeout=timeout)
        try:
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            connection.request("GET", get.get("path", "/"), headers=headers)
            return 200 <= connection.getresponse().status < 400
        except OSError:
            return False
        finally:
            connection.close()
    if "tcpSocket" in spec:
        try:
            socket.create_connection((spec["tcpSocket"].get("host") or target.ip,
                                      _port(spec["tcpSocket"]["port"], target)), timeout=timeout).close()
            return True
        except OSError:
            return False
    if "exec" in spec:
        try:
            return subprocess.run(spec["exec"]["command"], env=dict(target.env), timeout=timeout,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False
    return False


def _port(port: int | str, target: Target) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    return target.ports[port]
