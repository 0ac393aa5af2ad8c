#!/usr/bin/env python
"""Shard copies (spec.parameterServers.backups) and the journal: what each way of keeping
acknowledged updates costs, and how fast a backup takes over.

    python benchmarks/backups_bench.py [--runs 3] [--kills 5] [--json out.json]

Figures, merged into --json under "backups" (each a median with min and max):

  updates_per_s.{backups_0, journal, backups_1, min_in_sync_2}
      Global updates per second of the compute-bound job of e2e_bench.py (784-512-512-10
      MLP, batch 128, 2 shards, 2 replicas, every step): with no backup; with no backup and
      spec.parameterServers.journal; with 1 backup per shard; with 1 backup and minInSync 2.
      The step rate between the chief's first evaluation after the warm-up and its last.
      Runs alternate between the settings. ratio_1_over_0, ratio_journal_over_0 and
      ratio_min_in_sync_2_over_0 are medians of each round's ratio to backups_0.
  failover_s, failover_stall_s
      Seconds from a SIGKILL (failover_s), or a SIGSTOP (failover_stall_s: the process is
      frozen, its sockets stay open; SIGCONT once its backup took over), of shard 1's
      primary to the first push a replica is told shard 1 applied after it (its backup, now
      primary, applied it): the digits example with backups: 1, in local mode; --kills of
      each in one run, each once both copies of shard 1 are in sync again. Polled every POLL_S.
  backup_stall_s
      The longest pause in shard 1's acknowledged pushes after a SIGSTOP of its backup (held
      STALL_S): how long a frozen backup holds its primary's replies up before it is taken
      out of the in-sync set.
"""
from __future__ import annotations

import argparse
import copy
import json
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "operator"), str(REPO / "runtime")]

from prometheus_client.parser import text_string_to_metric_families

from distbelief.operator.local import local
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract

import e2e_bench
from figures import interleaved, save, summarize

POLL_S = 0.01
STALL_S = 7.0     # a frozen backup stays frozen this long
PRIMARY, BACKUP = 2, 1  # distbelief_copy_role
WATCHED_SHARD = 1  # shard 0's first copy runs the chief; shard 1's kills leave it alone


# How acknowledged updates are kept: spec.parameterServers fields of each setting.
RULES = {"backups_0": {}, "journal": {"journal": True}, "backups_1": {"backups": 1},
         "min_in_sync_2": {"backups": 1, "minInSync": 2}}


def updates_rate(servers: dict) -> float:
    workload = e2e_bench.WORKLOADS["compute_bound"]
    job = e2e_bench.workload_job("compute_bound", workload)
    job["spec"]["parameterServers"].update(servers)
    history = e2e_bench.run_job(job)[1]
    warm = [h for h in history if h["elapsed"] >= workload.warmup_s]
    first, last = warm[0], warm[-1]
    return (last["step"] - first["step"]) / (last["time"] - first["time"])


def metrics(pod: local.LocalPod) -> dict[tuple[str, str], float]:
    """(name, shard label) -> value of a pod's samples; {} while it does not answer."""
    try:
        with urllib.request.urlopen(pod.metrics_url, timeout=1) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return {(s.name, s.labels.get("shard", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def acknowledged(run: local.LocalRun) -> float:
    name = contract.Metric.WORKER_PUSHES_ACKNOWLEDGED + "_total"
    return sum(metrics(pod).get((name, str(WATCHED_SHARD)), 0.0) for pod in run.workers)


def watched_copies(run: local.LocalRun) -> list[local.LocalPod]:
    config = run.job.config
    return [pod for pod in run.shards
            if config.copy_of(contract.shard_index_from_pod_name(pod.name))[0] == WATCHED_SHARD]


def primary_in_sync(copies: list[local.LocalPod]) -> local.LocalPod | None:
    """The primary of the watched shard, once every other copy says it is its backup and the
    primary counts them all in sync (a primary that just lost its lease may still say it is
    one for a moment: then another copy says so too)."""
    roles = {pod.name: metrics(pod) for pod in copies}
    primaries = [pod for pod in copies if roles[pod.name].get(("distbelief_copy_role", str(WATCHED_SHARD))) == PRIMARY]
    backups = [pod for pod in copies if roles[pod.name].get(("distbelief_copy_role", str(WATCHED_SHARD))) == BACKUP]
    if len(primaries) != 1 or len(backups) != len(copies) - 1:
        return None
    in_sync = roles[primaries[0].name].get(("distbelief_copies_in_sync", str(WATCHED_SHARD)))
    return primaries[0] if in_sync == len(copies) else None


def in_sync_primary(run: local.LocalRun) -> tuple[local.LocalPod, list[local.LocalPod]]:
    """The watched shard's primary, in sync with its backup for a second at least."""
    copies = watched_copies(run)
    while True:
        primary = primary_in_sync(copies)
        if primary is not None:
            time.sleep(1.0)
            if primary_in_sync(copies) is primary:
                return primary, copies
        time.sleep(0.1)


def one_failover(run: local.LocalRun, how: signal.Signals = signal.SIGKILL) -> float:
    primary, copies = in_sync_primary(run)
    before = acknowledged(run)
    hit = time.monotonic()
    primary.signal(how)
    survivor = next(pod for pod in copies if pod is not primary)
    try:
        while True:
            promoted = metrics(survivor).get(("distbelief_copy_role", str(WATCHED_SHARD))) == PRIMARY
            if promoted and acknowledged(run) > before:
                return time.monotonic() - hit
            time.sleep(POLL_S)
    finally:
        primary.signal(signal.SIGCONT)


def one_backup_stall(run: local.LocalRun) -> float:
    primary, copies = in_sync_primary(run)
    backup = next(pod for pod in copies if pod is not primary)
    stopped = time.monotonic()
    backup.signal(signal.SIGSTOP)
    last, count, longest = stopped, acknowledged(run), 0.0
    try:
        while time.monotonic() - stopped < STALL_S:
            now, seen = time.monotonic(), acknowledged(run)
            if seen > count:
                longest, last, count = max(longest, now - last), now, seen
            time.sleep(POLL_S)
    finally:
        backup.signal(signal.SIGCONT)
    return max(longest, time.monotonic() - last)


def failover_times(kills: int) -> dict[str, list[float]]:
    doc = copy.deepcopy(e2e_bench.example("digits-mlp.yaml"))
    doc["spec"]["parameterServers"]["backups"] = 1
    doc["spec"]["training"]["maxSteps"] = 10_000_000
    doc["spec"]["runPolicy"]["backoffLimit"] = kills + 1
    with tempfile.TemporaryDirectory() as tmp:
        run = local.LocalRun(DistBeliefJob.validated(doc), tmp)
        thread = threading.Thread(target=lambda: run.run(progress=False), daemon=True)
        thread.start()
        try:
            return {"failover_s": [one_failover(run) for _ in range(kills)],
                    "failover_stall_s": [one_failover(run, signal.SIGSTOP) for _ in range(kills)],
                    "backup_stall_s": [one_backup_stall(run) for _ in range(kills)]}
        finally:
            run.interrupt()
            thread.join(timeout=120)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    failures: list[dict] = []
    rates = interleaved(args.runs, {name: lambda run, servers=servers: updates_rate(servers)
                                    for name, servers in RULES.items()}, failures, what="updates/s ")
    ratios = {f"ratio_{name}_over_0": summarize([b / a for a, b in zip(rates["backups_0"], rates[rule]) if a and b])
              for name, rule in (("1", "backups_1"), ("journal", "journal"), ("min_in_sync_2", "min_in_sync_2"))}
    times = failover_times(args.kills) if args.kills else {}
    results = {"backups": {
        "updates_per_s": {name: summarize(values) for name, values in rates.items()},
        **ratios,
        **{name: summarize(values) for name, values in times.items()},
        "definition": "compute_bound job of e2e_bench.py (2 shards, 2 replicas) with 0 backups, 0 and the journal, "
                      "1 backup, and 1 backup at minInSync 2; "
                      "failover: SIGKILL (failover_s) or SIGSTOP (failover_stall_s) of shard 1's primary to the "
                      "first push a replica is told shard 1 applied after it; backup_stall_s: the longest pause in "
                      "shard 1's acknowledgements while its backup is frozen; digits example with backups: 1, "
                      "local mode",
        "failures": failures,
    }}
    print(json.dumps(results, indent=2))
    save(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
