"""Local pods' memory: the watchdog kills a pod over its resources.limits.memory as a
cluster's OOM killer would, leaves one under it alone, and notes each pod's own peak."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from distbelief.operator.local import podusage
from distbelief.operator.local.localpods import LocalPod
from distbelief.operator.status import scrape

from support.waiting import eventually

MiB = 1 << 20


def _pod(tmp_path: Path, name: str, code: str, limit: str | None) -> LocalPod:
    return LocalPod(name=name, role="worker", argv=[sys.executable, "-c", code], env={},
                    log_path=str(tmp_path / f"{name}.log"), ports={}, memory_limit=limit)


def _holding(mib: int, then: str) -> str:
    """A child that grows to mib MiB of touched memory in 8 MiB steps, then runs `then`."""
    return f"import time\nheld = []\nfor _ in range({mib} // 8):\n    held.append(b'x' * (8 << 20))\n" \
           f"    time.sleep(0.01)\n{then}\n"


def _wait_for_exit(pod: LocalPod, timeout: float = 30.0) -> int:
    eventually(lambda: pod.poll() is not None, timeout, what=f"{pod.name} exits")
    return pod.exit_code


def test_a_pod_over_its_memory_limit_is_killed_and_said_to_be_oom_killed(tmp_path: Path) -> None:
    pod = _pod(tmp_path, "big-worker-0", _holding(160, "time.sleep(60)"), limit="64Mi")
    with podusage.MemoryWatchdog(lambda: [pod]):
        pod.start()
        code = _wait_for_exit(pod)
    assert code == -signal.SIGKILL
    assert pod.oom_resident is not None and pod.oom_resident > 64 * MiB
    assert pod.usage.oom_kills == 1 and pod.usage.peak_rss >= pod.oom_resident
    assert pod.ending().startswith("big-worker-0 was OOMKilled (exit code 137): ")
    assert pod.ending().endswith("over its resources.limits.memory 64Mi")
    assert pod.figures()["oomKills"] == 1 and pod.figures()["memoryLimit"] == "64Mi"


def test_a_pod_under_its_limit_runs_to_its_end_and_its_own_peak_is_noted(tmp_path: Path) -> None:
    # The launcher holds more than the pod: Linux counts that in the pod's ru_maxrss, which
    # must then not be taken for the pod's own peak.
    ballast = b"x" * (200 * MiB)
    pod = _pod(tmp_path, "small-worker-0", _holding(40, "time.sleep(0.5)"), limit="512Mi")
    with podusage.MemoryWatchdog(lambda: [pod]):
        pod.start()
        code = _wait_for_exit(pod)
    assert code == 0 and pod.oom_resident is None and pod.usage.oom_kills == 0
    assert 40 * MiB <= pod.usage.peak_rss < 40 * MiB + len(ballast) // 2
    assert pod.ending() == "small-worker-0 exited with code 0"


def test_a_pod_without_a_limit_is_never_killed_and_reports_no_limit(tmp_path: Path) -> None:
    pod = _pod(tmp_path, "free-worker-0", _holding(32, "time.sleep(0.3)"), limit=None)
    with podusage.MemoryWatchdog(lambda: [pod]):
        pod.start()
        assert _wait_for_exit(pod) == 0
    assert "oomKills" not in pod.figures() and pod.figures()["peakRssBytes"] >= 32 * MiB


def test_traffic_adds_up_over_restarts_and_keeps_the_last_value_seen() -> None:
    usage = podusage.PodUsage()
    usage.scraped(scrape.Figures(bytes_in=100, bytes_out=10))
    usage.scraped(scrape.Figures(bytes_in=300, bytes_out=30))
    usage.scraped(scrape.Figures())  # the pod did not answer: the last value seen stands
    usage.new_run()                  # restarted: its counters start again from zero
    usage.scraped(scrape.Figures(bytes_in=50, bytes_out=5))
    assert usage.figures() == {"peakRssBytes": 0, "bytesIn": 350, "bytesOut": 35}


def test_an_ended_process_not_yet_reaped_has_no_memory_to_read() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    eventually(lambda: b"State:\tZ" in Path(f"/proc/{child.pid}/status").read_bytes(), 30, interval=0.02,
               what="the child a zombie (its memory freed)")
    assert podusage.memory_of(child.pid) is None
    child.wait()
    assert podusage.memory_of(child.pid) is None
