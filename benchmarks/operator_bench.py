#!/usr/bin/env python
"""operator_create_to_children_s: from creating DistBeliefJobs on the real control plane
(kube_harness.py: ../shared/kube/control-plane) to the operator (`distbelief operator`, a
local process) having created every child of each job.

    python benchmarks/operator_bench.py [--runs 5] [--jobs 50] [--timeout 120] [--json PATH]

"All children" is what reconcile() writes on a job's first create, for
examples/digits-mlp.yaml: Secret <job>-keys, ConfigMap <job>-config, Service <job>-ps,
StatefulSet <job>-ps, Deployment <job>-worker, PodDisruptionBudget <job>-ps and
NetworkPolicy <job>-ps (rendered here as the operator renders them, so the list follows
the renderer).

One control plane serves every run (etcd, API server, controller-manager and scheduler:
the StatefulSets and Deployments get their pods, which stay Pending, as there are no
nodes). Each run gets a namespace of its own and a fresh operator watching only it, so no
earlier run's jobs or status timers are in its way. Start-up is outside the figure: the
clock starts once the operator has fully reconciled one warm-up job (its children exist
and kopf has written its diff-base annotation, i.e. the handler has returned; lazy
imports and the first keypair are not timed either). Then --jobs jobs are created back to
back (jobs_1: one job) and the children are seen in the benchmark's watches; the figure
is first create -> last child seen. Per-job latency (own create -> own last child) is
summarised by its median and p90 over each run, and the API requests the operator made in
that window (the API server's audit log of its ServiceAccount) by their number per job.

The operator runs with its default status interval (DISTBELIEF_STATUS_INTERVAL, 5 s
unless set) and its metrics URL pointed at the chiefs' stub (kube_harness.Chiefs), so each
status timer's scrape is answered at once. Each job's timer first fires 1 s after the
operator sees it, so with 50 jobs the early jobs' status reads and patches compete with the
later jobs' reconciles, as they would in a cluster.

Before issue 40 this ran against a test API emulator (since retired): 0.022 s for one job and
0.90 s for 50 there; the real API server, with its admission, storage and controllers on
the same 2 cores, is slower, so figures from before and after the move do not compare.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kube_harness as kh
from figures import summarize

SETTLED = "kopf.distbelief.io/last-handled-configuration"  # written once a job's handlers are done
MANIFEST = yaml.safe_load((kh.REPO / "examples" / "digits-mlp.yaml").read_text())


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def job_doc(namespace: str, name: str) -> dict:
    doc = copy.deepcopy(MANIFEST)
    doc["metadata"] = {"name": name, "namespace": namespace}
    return doc


def create_and_wait(api: kh.Api, seen: kh.ChildrenSeen, audit: kh.AuditTail, namespace: str, names: list[str],
                    timeout: float, operator: kh.Operator) -> tuple[float, list[float], float]:
    """Create the jobs back to back; (first create -> last child seen, per-job latencies,
    API requests the operator made meanwhile per job)."""
    wall = time.time()
    created: dict[str, float] = {}
    for name in names:
        created[name] = time.monotonic()
        api.create(kh.JOBS, namespace, job_doc(namespace, name))
    deadline = time.monotonic() + timeout
    while True:
        with seen.lock:
            done = {name: seen.complete[(namespace, name)] for name in names if (namespace, name) in seen.complete}
        if len(done) == len(names):
            break
        operator.alive()
        if time.monotonic() > deadline:
            missing = [n for n in names if n not in done]
            raise kh.HarnessError(f"{len(missing)} of {len(names)} jobs still lack children after {timeout} s: "
                                  f"{missing[:3]}")
        time.sleep(0.01)
    time.sleep(1.0)  # the audit log is written as requests complete: let the window's last ones land
    requests = sum(audit.window(wall, time.time()).values()) / len(names)
    first = min(created.values())
    return max(done.values()) - first, [done[n] - created[n] for n in names], requests


def one_run(plane: kh.ControlPlane, api: kh.Api, seen: kh.ChildrenSeen, audit: kh.AuditTail, chiefs: kh.Chiefs,
            folder: Path, jobs: int, run: int, timeout: float) -> tuple[float, list[float], float]:
    namespace = f"bench-{jobs}-{run}"
    kh.ensure_namespace(api, namespace)
    operator = kh.Operator(plane, folder, chiefs.url, namespaces=[namespace])
    operator.start()
    try:
        try:
            create_and_wait(api, seen, audit, namespace, ["warmup"], timeout, operator)
            kh.wait_until("the warm-up job settled", lambda: SETTLED in (
                (api.get(kh.JOBS, namespace, "warmup") or {}).get("metadata", {}).get("annotations") or {}), timeout,
                alive=operator.alive)
            return create_and_wait(api, seen, audit, namespace, [f"job-{i:03d}" for i in range(jobs)], timeout,
                                   operator)
        except kh.HarnessError:
            print(operator.log.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
    finally:
        operator.stop()


def measure(runs: int, jobs: int, timeout: float) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp, kh.Stack() as stack:
        folder = Path(tmp)
        plane = stack.start(kh.ControlPlane(folder))
        api = plane.api()
        kh.install_crd(api)
        chiefs = stack.start(kh.Chiefs())
        seen = kh.ChildrenSeen(kh.child_suffixes(job_doc("ns", "x")))
        for watch in seen.watches(api):
            stack.start(watch)
        audit = kh.AuditTail(plane.audit_log)
        for n in (1, jobs):
            totals, medians, p90s, requests = [], [], [], []
            for run in range(runs):
                total, per_job, per_job_requests = one_run(plane, api, seen, audit, chiefs, folder, n, run, timeout)
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
        meta = {"runs": args.runs, "backend": "control-plane (kube-apiserver 1.36)",
                "children": sorted(kh.child_suffixes(job_doc("ns", "x"))),
                "status_interval_s": float(os.environ.get("DISTBELIEF_STATUS_INTERVAL", "5")),
                "kopf": metadata.version("kopf"), "python": platform.python_version(),
                "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}
        Path(args.json).write_text(json.dumps({"operator_create_to_children_s": out, "metadata": meta},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
