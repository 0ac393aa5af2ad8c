"""benchmarks/operator_scale.py end to end at the smallest scale (3 jobs on 1 fake node): a
control plane of its own, KWOK, the operator and the chiefs' stub come up, the jobs run
through Pending, Running and Succeeded, every figure of issue 40 comes out, and nothing
the run started is left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.cluster import unavailable
from support.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import kube_harness

SCALE = REPO / "benchmarks" / "operator_scale.py"


def still_running(marker: str) -> list[str]:
    """The command lines of processes that mention marker (the run's folder)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in command and int(pid) != os.getpid():
            found.append(command)
    return found


def test_the_scale_benchmark_runs_jobs_through_their_phases_and_stops_what_it_started(tmp_path: Path) -> None:
    if not kube_harness.SHARED.exists():
        unavailable(f"no control plane script at {kube_harness.SHARED}")
    try:
        kube_harness.kwok_binary()
    except (kube_harness.HarnessError, OSError, subprocess.TimeoutExpired) as exc:
        unavailable(f"no kwok (tools/fetch-go-tools kwok): {exc}")
    folder, out = tmp_path / "run", tmp_path / "scale.json"
    done = subprocess.run([sys.executable, str(SCALE), "--jobs", "3", "--nodes", "1", "--steady", "7",
                           "--timeout", "120", "--keep", str(folder), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert still_running(str(folder)) == []
    figures = json.loads(out.read_text())["operator_scale"]
    for name in ("apply_to_children_s", "apply_to_running_s", "status_lag_ready_s", "status_lag_finished_s"):
        assert figures[name]["count"] == 3, name
        assert 0 <= figures[name]["p50"] <= figures[name]["p99"] < 120, name
    assert figures["status_lag_s"]["count"] == 6
    assert figures["requests_per_job_per_minute"]["run"] > 0
    steady = figures["phases"]["steady"]
    # 7 s hold more than one status pass (every 5 s): each patches the status and reads nothing
    # from the API server, as the audit log shows (the operator's watches: cluster/observing.py)
    assert "patch distbeliefjobs/status" in steady["requests_by_verb"]
    assert not {"get statefulsets", "get deployments", "list pods"} & steady["requests_by_verb"].keys()
    run = figures["phases"]["run"]
    # the operator alone is a ServiceAccount: its flow schema's count and the audit log's agree
    # but for the requests at the window's edges (one counted by time, the other by snapshot)
    assert run["operator_requests"] > 0 and abs(run["flowcontrol"]["dispatched"] - run["operator_requests"]) <= \
        0.2 * run["operator_requests"] + 5
    assert run["apiserver_latency_s"]["all"]["p99"] > 0
    assert 0 < figures["operator"]["rss_peak_mib"] < 1024
    assert {t["figure"] for t in figures["targets"]} == {"apply_to_children_p99_s", "status_lag_p99_s",
                                                         "operator_rss_peak_mib", "throttled_over_1s"}
    assert "target apply_to_children_p99_s" in done.stdout
