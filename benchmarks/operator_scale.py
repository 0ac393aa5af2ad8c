#!/usr/bin/env python
"""The operator at scale (issue 40): DistBeliefJobs on the real control plane, their pods
on KWOK's fake nodes, the operator as a local process, every chief answered by a stub.

    python benchmarks/operator_scale.py [--jobs 1000] [--nodes 100] [--shards 2] [--workers 8]
        [--namespaces 1] [--rate 20] [--steady 120] [--status-interval S] [--operator-env NAME=VALUE]
        [--timeout 3600] [--json PATH] [--keep DIR]

One run, in order (kube_harness.py has the parts):
1. The control plane (../shared/kube/control-plane), the CRD, --namespaces namespaces, KWOK
   with --nodes fake nodes (128 CPUs, 512 GiB, 250 pods each), a PersistentVolume bound
   ahead to each checkpoint claim the jobs' shards will make, the chiefs' stub, and the
   operator (`distbelief operator`, clusterwide, status every 5 s as the chart's default)
   with DISTBELIEF_METRICS_URL pointing at the stub.
2. --jobs jobs (examples/digits-mlp.yaml with --shards shards and --workers workers) are
   created --rate a second (0: back to back), spread over the namespaces in turn. KWOK makes
   every pod Running and Ready once the scheduler binds it.
3. Once every job's status shows all its shards and workers ready, --steady seconds with
   nothing changing: the steady state of --jobs running jobs.
4. The stub's chief of each job then reports the job ended (Succeeded), --rate jobs a
   second in the order they were created; the run ends when every job is Succeeded.

Figures (under "operator_scale" in --json), against issue 40's targets:
- apply_to_children_s: from a job's create to the last of its children (keys Secret,
  ConfigMap, Service, StatefulSet, Deployment, PodDisruptionBudget, NetworkPolicy) seen in
  the benchmark's watches; p50, p99, max over the jobs. Target p99 < 5 s.
- status_lag_s: from a child's change to the job's status showing it, two changes per job:
  ready (the later of the StatefulSet's and the Deployment's readyReplicas reaching the
  full count, as the watches see them, to the job's status.parameterServers.ready and
  status.workers.ready showing it) and finished (the stub's chief reporting the end, to
  phase Succeeded). Target p99 < 10 s.
- requests_per_job_per_minute: the operator's requests (the API server's audit log of its
  ServiceAccount; watches counted when they start) in the steady window and over the run,
  by verb and resource; cross-checked against the API server's
  apiserver_flowcontrol_dispatched_requests_total of flow schema service-accounts, which
  only the operator uses here.
- operator: peak RSS and mean CPU (cores), from /proc, in each phase. Target RSS < 1 GiB.
- apiserver_latency_s: apiserver_request_duration_seconds (every client, watches left
  out) over each phase, p50 and p99 by verb; and the operator's own requests' time in the
  server, from the audit log.
- throttling: no client here has a rate limiter (kopf's aiohttp connector has no limit, the
  kubernetes client none), so a request can wait only in the API server's priority and
  fairness queues (apiserver_flowcontrol_request_wait_duration_seconds of the operator's
  flow schema; and 429s) or in kopf's error throttling ("Throttling for" in its log).
  Target: no request held more than 1 s. Beside it, how late each status pass came (the
  stub's scrape interval less the status interval): a pass waiting for one of kopf's
  handler threads waits in the operator, not in a client.
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kube_harness as kh

from distbelief.runtime import contract

MANIFEST = yaml.safe_load((kh.REPO / "examples" / "digits-mlp.yaml").read_text())
TARGETS = {"apply_to_children_p99_s": 5.0, "status_lag_p99_s": 10.0, "operator_rss_peak_mib": 1024.0,
           "throttled_over_1s": 0}
Key = tuple[str, str]


def bench_job(namespace: str, name: str, shards: int, workers: int) -> dict[str, Any]:
    job = copy.deepcopy(MANIFEST)
    job["metadata"] = {"name": name, "namespace": namespace}
    job["spec"]["parameterServers"]["shards"] = shards
    job["spec"]["workers"]["replicas"] = workers
    job["spec"]["training"]["maxDuration"] = "24h"   # the chief ends it, not the deadline
    return job


class Record(kh.ChildrenSeen):
    """Each job's timeline (monotonic seconds), from the watches' callbacks."""

    def __init__(self, shards: int, workers: int) -> None:
        super().__init__(kh.child_suffixes(bench_job("ns", "x", shards, workers)))
        self.shards, self.workers = shards, workers
        self.applied: dict[Key, float] = {}
        self.sts_ready: dict[Key, float] = {}
        self.deploy_ready: dict[Key, float] = {}
        self.status_ready: dict[Key, float] = {}
        self.phases: dict[Key, dict[str, float]] = collections.defaultdict(dict)
        self.finished: dict[Key, float] = {}

    def seen(self, kind: str, key: Key, obj: dict, now: float) -> None:
        status, wanted = obj.get("status") or {}, (obj.get("spec") or {}).get("replicas")
        if kind == "StatefulSet" and wanted and status.get("readyReplicas", 0) >= self.shards:
            self.sts_ready.setdefault(key, now)
        if kind == "Deployment" and wanted and status.get("readyReplicas", 0) >= self.workers:
            self.deploy_ready.setdefault(key, now)

    def on_job(self, event: str, obj: dict, now: float) -> None:
        if event == "DELETED":
            return
        meta, status = obj["metadata"], obj.get("status") or {}
        key = (meta["namespace"], meta["name"])
        with self.lock:
            self.events["DistBeliefJob"] += 1
            if status.get("phase"):
                self.phases[key].setdefault(status["phase"], now)
            if (status.get("parameterServers") or {}).get("ready", 0) >= self.shards and \
                    (status.get("workers") or {}).get("ready", 0) >= self.workers:
                self.status_ready.setdefault(key, now)

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {"applied": len(self.applied), "children": len(self.complete),
                    "shards_ready": len(self.sts_ready), "workers_ready": len(self.deploy_ready),
                    "status_ready": len(self.status_ready),
                    "running": sum(1 for p in self.phases.values() if "Running" in p),
                    "finished": len(self.finished),
                    "succeeded": sum(1 for p in self.phases.values() if "Succeeded" in p)}

    def apply_to_children(self) -> list[float]:
        return [self.complete[k] - t for k, t in self.applied.items() if k in self.complete]

    def ready_lag(self) -> list[float]:
        lags = []
        for key, shown in self.status_ready.items():
            if key in self.sts_ready and key in self.deploy_ready:
                lags.append(shown - max(self.sts_ready[key], self.deploy_ready[key]))
        return lags

    def finish_lag(self) -> list[float]:
        return [self.phases[k]["Succeeded"] - t for k, t in self.finished.items() if "Succeeded" in self.phases.get(k, {})]

    def apply_to_running(self) -> list[float]:
        return [self.phases[k]["Running"] - t for k, t in self.applied.items() if "Running" in self.phases.get(k, {})]


def paced(items: list[Key], rate: float, act: Any, record_to: dict[Key, float], lock: threading.Lock) -> None:
    """act(key) for each key, rate a second (0: back to back); its monotonic time recorded."""
    start = time.monotonic()
    for i, key in enumerate(items):
        if rate > 0:
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        now = time.monotonic()
        act(key)
        with lock:
            record_to[key] = now


class Phases:
    """The run's phases: monotonic and wall-clock bounds, and a metrics snapshot at each."""

    def __init__(self, api: kh.Api) -> None:
        self.api = api
        self.marks: list[tuple[str, float, float, str]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.monotonic(), time.time(), self.api.text("/metrics")))

    def windows(self) -> list[tuple[str, tuple[float, float, str], tuple[float, float, str]]]:
        """(name, start, end) for each phase between two marks, and "run" for the whole."""
        out = [(self.marks[i][0], self.marks[i][1:], self.marks[i + 1][1:]) for i in range(len(self.marks) - 1)]
        return out + [("run", self.marks[0][1:], self.marks[-1][1:])]


def request_latency(before: str, after: str) -> dict[str, Any]:
    """p50 and p99 of apiserver_request_duration_seconds between two snapshots, all verbs but
    the long-running ones together and by verb."""
    name = "apiserver_request_duration_seconds"
    short = ("WATCH", "CONNECT", "WATCHLIST")
    out: dict[str, Any] = {}
    for verb in ("all", "GET", "LIST", "POST", "PATCH", "PUT", "DELETE"):
        def keep(labels: dict[str, str], verb: str = verb) -> bool:
            return labels.get("verb") not in short and (verb == "all" or labels.get("verb") == verb)
        delta = kh.histogram_delta(kh.histogram(after, name, keep), kh.histogram(before, name, keep))
        count = max(delta.values()) if delta else 0
        if count:
            out[verb] = {"count": int(count), "p50": kh.histogram_quantile(0.5, delta),
                         "p99": kh.histogram_quantile(0.99, delta)}
    return out


def flow_figures(before: str, after: str, schema: str = "service-accounts") -> dict[str, Any]:
    """The operator's flow schema in the API server's priority and fairness: requests
    dispatched, rejected (429), and their wait in its queues."""
    def mine(labels: dict[str, str]) -> bool:
        return labels.get("flow_schema") == schema

    wait = kh.histogram_delta(kh.histogram(after, "apiserver_flowcontrol_request_wait_duration_seconds", mine),
                              kh.histogram(before, "apiserver_flowcontrol_request_wait_duration_seconds", mine))
    dispatched = kh.counter_sum(after, "apiserver_flowcontrol_dispatched_requests_total", mine) - \
        kh.counter_sum(before, "apiserver_flowcontrol_dispatched_requests_total", mine)
    rejected = kh.counter_sum(after, "apiserver_flowcontrol_rejected_requests_total", mine) - \
        kh.counter_sum(before, "apiserver_flowcontrol_rejected_requests_total", mine)
    return {"dispatched": int(dispatched), "rejected": int(rejected),
            "wait_p99_s": kh.histogram_quantile(0.99, wait), "wait_over_1s": int(kh.over(wait, 1.0))}


def per_job_minute(count: float, jobs: int, seconds: float) -> float | None:
    return count / jobs / (seconds / 60) if jobs and seconds > 0 else None


def own_reconciles(text: str) -> dict[str, Any]:
    buckets = kh.histogram(text, "distbelief_operator_reconcile_seconds")
    return {"reconciles": int(max(buckets.values())) if buckets else 0,
            "reconcile_p50_s": kh.histogram_quantile(0.5, buckets), "reconcile_p99_s": kh.histogram_quantile(0.99, buckets),
            "errors": {labels.get("handler", ""): int(v) for m, labels, v in kh.samples(
                text, ["distbelief_operator_errors_total"]) if m == "distbelief_operator_errors_total"}}


def measure(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    namespaces = [f"scale-{i:02d}" for i in range(args.namespaces)]
    jobs: list[Key] = [(namespaces[i % len(namespaces)], f"job-{i:04d}") for i in range(args.jobs)]
    record = Record(args.shards, args.workers)
    started = time.monotonic()
    with kh.Stack() as stack:
        plane = stack.start(kh.ControlPlane(folder))
        api = plane.api()
        kh.install_crd(api)
        for namespace in namespaces:
            kh.ensure_namespace(api, namespace)
        kwok = stack.start(kh.Kwok(plane, folder))
        kwok.add_nodes(api, args.nodes)
        kh.claim_volumes(api, [(ns, f"{contract.CHECKPOINT_VOLUME}-{contract.JobNames(name).ps}-{k}")
                               for ns, name in jobs for k in range(args.shards)])
        chiefs = stack.start(kh.Chiefs())
        watches = [stack.start(watch) for watch in record.watches(api)]
        watches.append(stack.start(kh.Watch(api, kh.JOBS, record.on_job)))
        operator = stack.start(kh.Operator(plane, folder, chiefs.url, status_interval=args.status_interval,
                                           env=dict(e.split("=", 1) for e in args.operator_env)))
        audit = kh.AuditTail(plane.audit_log)
        assert operator.process is not None and kwok.process is not None
        sampler = stack.start(kh.Sampler({"operator": operator.process.pid, **plane.pids(),
                                          "kwok": kwok.process.pid, "benchmark": os.getpid()}))
        set_up = time.monotonic() - started
        print(f"set up in {set_up:.0f} s: {args.nodes} nodes, {len(jobs) * args.shards} volumes", flush=True)

        def alive() -> None:
            operator.alive()
            for watch in watches:
                watch.check()

        def wait_for(what: str, done: Any, timeout: float) -> None:
            deadline = time.monotonic() + timeout
            last = 0.0
            while not done():
                alive()
                if time.monotonic() > deadline:
                    raise kh.HarnessError(f"timed out waiting for {what}: {record.counts()}")
                if time.monotonic() - last >= 15:
                    audit.read()   # a chunk at a time, as it grows
                    op = sampler.summary("operator", time.monotonic() - 15)
                    print(f"  {time.monotonic() - started:6.0f} s {record.counts()} operator "
                          f"{op['cpu_cores'] or 0:.2f} cores {op['rss_peak_mib'] or 0:.0f} MiB", flush=True)
                    last = time.monotonic()
                time.sleep(0.5)

        phases = Phases(api)
        phases.mark("apply")
        creator = threading.Thread(target=paced, args=(jobs, args.rate, lambda key: api.create(
            kh.JOBS, key[0], bench_job(key[0], key[1], args.shards, args.workers)), record.applied, record.lock),
            daemon=True)
        creator.start()
        wait_for("every job's children", lambda: len(record.complete) >= len(jobs), args.timeout)
        creator.join()
        phases.mark("start")
        wait_for("every job's status to show its pods ready", lambda: len(record.status_ready) >= len(jobs), args.timeout)
        phases.mark("steady")
        end = time.monotonic() + args.steady
        wait_for("the steady window", lambda: time.monotonic() >= end, args.steady + 60)
        phases.mark("finish")
        finisher = threading.Thread(target=paced, args=(jobs, args.rate, lambda key: chiefs.finish(*key),
                                                        record.finished, record.lock), daemon=True)
        finisher.start()
        wait_for("every job Succeeded", lambda: record.counts()["succeeded"] >= len(jobs), args.timeout)
        finisher.join()
        phases.mark("end")
        own = operator.own_metrics()
        throttled_lines = operator.throttled_lines()
        intervals = list(chiefs.intervals)
    return report(args, record, phases, sampler, audit, own, throttled_lines, intervals, set_up)


def report(args: argparse.Namespace, record: Record, phases: Phases, sampler: kh.Sampler, audit: kh.AuditTail,
           own: str, throttled_lines: int, intervals: list[float], set_up: float) -> dict[str, Any]:
    jobs = args.jobs
    windows = phases.windows()
    ready_lag, finish_lag = record.ready_lag(), record.finish_lag()
    by_phase: dict[str, Any] = {}
    for name, (m0, w0, before), (m1, w1, after) in windows:
        requests = audit.window(w0, w1)
        total = sum(requests.values())
        by_phase[name] = {
            "seconds": m1 - m0,
            "operator_requests": total,
            "requests_per_job_per_minute": per_job_minute(total, jobs, w1 - w0),
            "requests_by_verb": dict(requests.most_common()),
            "operator_request_latency_s": audit.latency_quantiles(w0, w1),
            "apiserver_latency_s": request_latency(before, after),
            "flowcontrol": flow_figures(before, after),
            "processes": {name: sampler.summary(name, m0, m1) for name in sampler.samples},
        }
        cores = by_phase[name]["processes"]
        if cores.get("machine", {}).get("cpu_cores") is not None:   # the rest of the machine's work
            ours = sum(p["cpu_cores"] or 0.0 for n, p in cores.items() if n != "machine")
            by_phase[name]["other_work_cores"] = cores["machine"]["cpu_cores"] - ours
    steady = by_phase["steady"]
    late = [max(0.0, i - (args.status_interval or 5.0)) for i in intervals]
    throttled = by_phase["run"]["flowcontrol"]["wait_over_1s"] + by_phase["run"]["flowcontrol"]["rejected"]
    figures = {
        "apply_to_children_s": kh.spread(record.apply_to_children()),
        "apply_to_running_s": kh.spread(record.apply_to_running()),
        "status_lag_s": kh.spread(ready_lag + finish_lag),
        "status_lag_ready_s": kh.spread(ready_lag),
        "status_lag_finished_s": kh.spread(finish_lag),
        "requests_per_job_per_minute": {"steady": steady["requests_per_job_per_minute"],
                                        "run": by_phase["run"]["requests_per_job_per_minute"]},
        "operator": {"rss_peak_mib": by_phase["run"]["processes"]["operator"]["rss_peak_mib"],
                     "cpu_cores": {name: p["processes"]["operator"]["cpu_cores"] for name, p in by_phase.items()},
                     **own_reconciles(own)},
        "throttling": {"client_rate_limiter": None, "kopf_throttling_lines": throttled_lines,
                       "apf_wait_over_1s": by_phase["run"]["flowcontrol"]["wait_over_1s"],
                       "apf_rejected": by_phase["run"]["flowcontrol"]["rejected"],
                       "apf_wait_p99_s": by_phase["run"]["flowcontrol"]["wait_p99_s"],
                       "status_pass_late_s": kh.spread(late),
                       "status_passes_late_over_1s": sum(1 for x in late if x > 1.0)},
        "phases": by_phase,
        "watch_events": dict(record.events),
    }
    values = {"apply_to_children_p99_s": figures["apply_to_children_s"]["p99"],
              "status_lag_p99_s": figures["status_lag_s"]["p99"],
              "operator_rss_peak_mib": figures["operator"]["rss_peak_mib"],
              "throttled_over_1s": throttled + throttled_lines}
    figures["targets"] = [{"figure": k, "value": values[k], "target": f"{'<' if k != 'throttled_over_1s' else '='} {v}",
                           "met": None if values[k] is None else (values[k] < v if k != "throttled_over_1s" else values[k] == 0)}
                          for k, v in TARGETS.items()]
    figures["config"] = {"jobs": jobs, "nodes": args.nodes, "shards": args.shards, "workers": args.workers,
                         "pods": jobs * (args.shards + args.workers), "namespaces": args.namespaces, "rate": args.rate,
                         "steady_s": args.steady, "status_interval_s": args.status_interval or 5.0,
                         "operator_env": args.operator_env,
                         "set_up_s": set_up, "kopf": metadata.version("kopf"), "python": platform.python_version(),
                         "cpus": os.cpu_count(), "loadavg_1m_end": os.getloadavg()[0],
                         "other_work_cores": by_phase["run"].get("other_work_cores")}
    return figures


def summary(figures: dict[str, Any]) -> list[str]:
    def f(value: Any, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    lines = []
    for name in ("apply_to_children_s", "apply_to_running_s", "status_lag_ready_s", "status_lag_finished_s",
                 "status_lag_s"):
        s = figures[name]
        lines.append(f"{name:<24} p50 {f(s['p50'])}  p99 {f(s['p99'])}  max {f(s['max'])}  ({s['count']} samples)")
    rq = figures["requests_per_job_per_minute"]
    lines.append(f"requests/job/minute      steady {f(rq['steady'])}  run {f(rq['run'])}")
    op = figures["operator"]
    cores = "  ".join(f"{k} {f(v)}" for k, v in op["cpu_cores"].items())
    lines.append(f"operator                 RSS peak {f(op['rss_peak_mib'], '.0f')} MiB  cores: {cores}")
    lines.append(f"the machine's other work {f(figures['config']['other_work_cores'])} cores over the run (2 cores in all)")
    for phase in ("steady", "run"):
        lat = figures["phases"][phase]["apiserver_latency_s"].get("all", {})
        mine = figures["phases"][phase]["operator_request_latency_s"]
        lines.append(f"apiserver latency {phase:<6} p50 {f(lat.get('p50'), '.3f')}  p99 {f(lat.get('p99'), '.3f')} s;"
                     f" the operator's requests p50 {f(mine['p50'], '.3f')}  p99 {f(mine['p99'], '.3f')} s")
    th = figures["throttling"]
    lines.append(f"throttling               APF waits > 1 s {th['apf_wait_over_1s']}, 429s {th['apf_rejected']}, "
                 f"kopf 'Throttling' {th['kopf_throttling_lines']}; status passes late p50 "
                 f"{f(th['status_pass_late_s']['p50'])} p99 {f(th['status_pass_late_s']['p99'])} s")
    for t in figures["targets"]:
        verdict = {True: "met", False: "MISSED", None: "no figure"}[t["met"]]
        lines.append(f"target {t['figure']:<26} {f(t['value'])} (target {t['target']}) {verdict}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--namespaces", type=int, default=1, help="the jobs are spread over this many namespaces")
    p.add_argument("--rate", type=float, default=20.0, help="jobs created (and later finished) a second; 0: at once")
    p.add_argument("--steady", type=float, default=120.0, help="seconds with every job running, before they finish")
    p.add_argument("--status-interval", type=float, default=None,
                   help="DISTBELIEF_STATUS_INTERVAL for the operator (default: the operator's, 5 s)")
    p.add_argument("--operator-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the operator (repeatable), e.g. MALLOC_ARENA_MAX=2")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed for each phase")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", default=None, metavar="DIR", help="work in DIR and keep it (logs, audit log)")
    args = p.parse_args()
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="operator-scale-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        figures = measure(args, folder)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print("\n".join(summary(figures)))
    if args.json:
        Path(args.json).write_text(json.dumps({"operator_scale": figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
