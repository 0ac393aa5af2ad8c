#!/usr/bin/env python
"""operator_create_to_children_s: from creating DistBeliefJobs in the Kubernetes API
emulator (tests/kube) to the operator (`distbelief operator`, a subprocess) having
created every child of each job.

    python benchmarks/operator_bench.py [--runs 5] [--jobs 50] [--timeout 120] [--json PATH]

"All children" is what reconcile() writes on a job's first create, for
examples/digits-mlp.yaml (no autoscaling, no NetworkPolicy): Secret <job>-keys,
ConfigMap <job>-config, Service <job>-ps, StatefulSet <job>-ps, Deployment <job>-worker.

Each run gets a fresh emulator and operator, so no earlier jobs' status timers run in the
background. Start-up is outside the figure: the clock starts only once the operator has
opened its watch on distbeliefjobs (seen in the emulator's request log) and has fully
reconciled one warm-up job: its children exist and kopf has written its diff-base
annotation, i.e. the handler has returned (so lazy imports and the first keypair, about
0.15 s on the first job, are not timed either).
Then --jobs jobs are created in-process, back to back (jobs_1: one job), and the store is
polled every 10 ms for the children still missing; the figure is first create -> last
child seen, so it is late by at most one poll (10 ms). Per-job latency (own create -> own
last child) is summarised by its median and p90 over each run, and the API requests the
operator made in that window (the emulator's request log) by their number per job.

The operator runs with its default status interval (DISTBELIEF_STATUS_INTERVAL, 5 s
unless set) and its metrics URL pointed at a closed loopback port, so each status timer's
scrape is refused at once instead of resolving cluster DNS names. Each job's timer first
fires 1 s after the operator sees it, so with 50 jobs the early jobs' status reads and
patches compete with the later jobs' reconciles, as they would in a cluster.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Iterator

import yaml

REPO = Path(__file__).resolve().parent.parent
PYTHONPATH = [str(REPO / "tests"), str(REPO / "operator"), str(REPO / "runtime")]
sys.path[:0] = PYTHONPATH

from kube import KubeEmulator
from kube.plugin import JOB_RESOURCE, project_emulator

from figures import summarize

NAMESPACE = "default"
POLL_S = 0.010
CHILDREN = [("v1/secrets", "{}-keys"), ("v1/configmaps", "{}-config"), ("v1/services", "{}-ps"),
            ("apps/v1/statefulsets", "{}-ps"), ("apps/v1/deployments", "{}-worker")]
WATCH_PATH = f"/apis/{JOB_RESOURCE.rsplit('/', 1)[0]}/namespaces/{NAMESPACE}/distbeliefjobs"
SETTLED = "kopf.distbelief.io/last-handled-configuration"  # written once a job's handlers are done
MANIFEST = yaml.safe_load((REPO / "examples" / "digits-mlp.yaml").read_text())


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def operator_running(kube: KubeEmulator, log_path: Path) -> Iterator[subprocess.Popen]:
    env = kube.env(PYTHONPATH=os.pathsep.join(PYTHONPATH),
                   DISTBELIEF_METRICS_URL=f"http://127.0.0.1:{closed_port()}/metrics")
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "distbelief.operator.cli", "operator",
                                    "--namespace", NAMESPACE, "--standalone"],
                                   env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def wait_watching(kube: KubeEmulator, process: subprocess.Popen, timeout: float) -> None:
    """Until the operator has a watch open on the jobs: kopf opens it after its startup
    handlers and initial list, and resumes it from that list, so no create is missed."""
    deadline = time.monotonic() + timeout
    while not any(r.path == WATCH_PATH and r.query.get("watch") == "true" for r in kube.requests):
        if process.poll() is not None:
            raise RuntimeError(f"the operator exited with {process.returncode} before watching")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the operator opened no watch on {WATCH_PATH} in {timeout}s")
        time.sleep(POLL_S)


def settled(job: dict | None) -> bool:
    return job is not None and SETTLED in (job["metadata"].get("annotations") or {})


def create_and_wait(kube: KubeEmulator, names: list[str], timeout: float) -> tuple[float, list[float], float]:
    """Create the jobs back to back; (first create -> last child seen, per-job latencies,
    API requests the operator made meanwhile per job)."""
    requests_before = len(kube.requests)
    created: dict[str, float] = {}
    for name in names:
        doc = copy.deepcopy(MANIFEST)
        doc["metadata"]["name"] = name
        created[name] = time.perf_counter()
        kube.create(JOB_RESOURCE, doc, NAMESPACE)
    missing = {name: [(r, p.format(name)) for r, p in CHILDREN] for name in names}
    done: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while True:
        for name, children in list(missing.items()):
            children[:] = [c for c in children if kube.get(c[0], c[1], NAMESPACE) is None]
            if not children:
                done[name] = time.perf_counter()
                del missing[name]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(missing)} of {len(names)} jobs still lack children after {timeout}s: "
                               f"{dict(list(missing.items())[:3])}")
        time.sleep(POLL_S)
    first = min(created.values())
    requests = (len(kube.requests) - requests_before) / len(names)
    return max(done.values()) - first, [done[n] - created[n] for n in names], requests


def one_run(jobs: int, timeout: float, folder: Path) -> tuple[float, list[float], float]:
    kube = project_emulator().start()
    try:
        kube.write_kubeconfig(folder / "kubeconfig")
        log_path = folder / f"operator-{jobs}.log"
        with operator_running(kube, log_path) as process:
            try:
                wait_watching(kube, process, timeout)
                create_and_wait(kube, ["warmup"], timeout)
                kube.wait_for(JOB_RESOURCE, "warmup", NAMESPACE, condition=settled, timeout=timeout)
                return create_and_wait(kube, [f"job-{i:03d}" for i in range(jobs)], timeout)
            except (RuntimeError, TimeoutError):
                print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
                raise
    finally:
        kube.stop()


def measure(runs: int, jobs: int, timeout: float) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, jobs):
            totals, medians, p90s, requests = [], [], [], []
            for _ in range(runs):
                total, per_job, per_job_requests = one_run(n, timeout, Path(tmp))
                totals.append(total)
                medians.append(statistics.median(per_job))
                p90s.append(p90(per_job))
                requests.append(per_job_requests)
            out[f"jobs_{n}"] = {**summarize(totals), "per_job_median": summarize(medians),
                                "per_job_p90": summarize(p90s), "api_requests_per_job": summarize(requests)}
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--jobs", type=int, default=50, help="jobs created at once in the second figure")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for each wait")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = measure(args.runs, args.jobs, args.timeout)
    for k, v in out.items():
        pm, pp = v["per_job_median"]["median"], v["per_job_p90"]["median"]
        print(f"operator_create_to_children_s {k:<8} {v['median']:.3f} [{v['min']:.3f}-{v['max']:.3f}]"
              f"  per job median {pm:.3f} p90 {pp:.3f}  API requests per job {v['api_requests_per_job']['median']:.1f}")
    if args.json:
        meta = {"runs": args.runs, "poll_s": POLL_S, "children": [r for r, _ in CHILDREN],
                "status_interval_s": float(os.environ.get("DISTBELIEF_STATUS_INTERVAL", "5")),
                "kopf": metadata.version("kopf"), "python": platform.python_version(),
                "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}
        Path(args.json).write_text(json.dumps({"operator_create_to_children_s": out, "metadata": meta},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
