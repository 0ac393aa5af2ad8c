"""What each local pod uses of this machine, and the memory limit a cluster would hold it to.

Peak resident set: the kernel's high-water mark of the pod's process (VmHWM in
/proc/<pid>/status), looked at every WATCH_SECONDS. It never decreases while the process
lives, so a look misses only what a pod grew in its last moments; wait4's ru_maxrss fills
that in when it can. It cannot always: Linux counts in a child's ru_maxrss the memory of
the process that started it (`distbelief run` itself, 100 MB or more), so it is exact only
when above the launcher's own high-water mark.

Memory limits: a pod whose container has resources.limits.memory is SIGKILLed as soon as
a look finds its resident set over the limit, as the kernel's OOM killer ends a container
over its cgroup's limit; local mode then reports it OOMKilled (exit code 137) and restarts
it with back-off, as a cluster's restart policy does. A watchdog, because the alternatives
are not honest here: RLIMIT_AS counts reserved address space (glibc's arenas, thread
stacks, ZeroMQ's), so a pod fails far below the resident memory a cgroup allows; a cgroup
needs root or a systemd delegation that `distbelief run` cannot count on. What a watchdog
cannot do: stop an allocation in its tracks. A pod may grow past its limit for up to
WATCH_SECONDS before it is killed (a cgroup would refuse the page at once).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Callable, Iterable

from distbelief.operator.status import scrape

log = logging.getLogger(__name__)

WATCH_SECONDS = 0.1
OOM_KILLED = "OOMKilled"
OOM_EXIT_CODE = 137  # 128 + SIGKILL: what a cluster reports for a container its OOM killer ended


@dataclasses.dataclass(frozen=True)
class Memory:
    resident: int   # bytes resident now (VmRSS)
    peak: int       # the most ever resident (VmHWM)


def memory_of(pid: int) -> Memory | None:
    """The process's resident memory, or None once it is gone (or a zombie, whose memory is freed)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(b":")
        if name in (b"VmRSS", b"VmHWM"):
            fields[name] = int(value.split()[0]) * 1024  # reported in kB
    if len(fields) < 2:
        return None
    return Memory(resident=fields[b"VmRSS"], peak=fields[b"VmHWM"])


def own_peak() -> int:
    """This process's high-water mark: what a child's ru_maxrss may include of ours."""
    memory = memory_of(os.getpid())
    return memory.peak if memory else 0


@dataclasses.dataclass
class PodUsage:
    """One pod's figures over the whole run, across its restarts. Traffic counters start
    from zero in each process: a run's last scraped values are added up when it ends."""

    peak_rss: int = 0
    bytes_in: int = 0       # of the runs that ended
    bytes_out: int = 0
    run_bytes_in: int = 0   # of the current run, as last scraped
    run_bytes_out: int = 0
    oom_kills: int = 0

    def new_run(self) -> None:
        self.bytes_in += self.run_bytes_in
        self.bytes_out += self.run_bytes_out
        self.run_bytes_in = self.run_bytes_out = 0

    def scraped(self, figures: scrape.Figures) -> None:
        if figures.bytes_in is not None and figures.bytes_out is not None:
            self.run_bytes_in, self.run_bytes_out = figures.bytes_in, figures.bytes_out

    def peaked(self, nbytes: int) -> None:
        self.peak_rss = max(self.peak_rss, nbytes)

    def figures(self) -> dict[str, Any]:
        """The pod's entry of report.json's pods (restarts and the limit are the pod's)."""
        return {"peakRssBytes": self.peak_rss, "bytesIn": self.bytes_in + self.run_bytes_in,
                "bytesOut": self.bytes_out + self.run_bytes_out}


def oom_message(pod: str, resident: int, limit: str) -> str:
    return f"{pod} was {OOM_KILLED} (exit code {OOM_EXIT_CODE}): {resident / 2 ** 20:.0f} MiB resident, over " \
           f"its resources.limits.memory {limit}"


class MemoryWatchdog:
    """A thread that, every interval, calls each pod's watch_memory(): its peak noted, and
    the pod killed when over its memory limit."""

    def __init__(self, pods: Callable[[], Iterable[Any]], interval: float = WATCH_SECONDS) -> None:
        self.pods, self.interval = pods, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watchdog", daemon=True)

    def __enter__(self) -> "MemoryWatchdog":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for pod in self.pods():
                pod.watch_memory()
