#!/usr/bin/env python
"""Our jobs against the peers a user would pick, in interleaved rounds, with the CPU each
system spends per example over one plain process's.

    python benchmarks/peer_rounds.py [--rounds 5] [--models compute_bound,communication_bound,large_dense]
        [--json out.json]

Each round runs, one after the other: every job of ours (e2e_bench.py's workloads, 2 shards
and 2 replicas: encrypted as a job runs by default, without keys, and the compute-bound one
with fetchEvery = pushEvery = 4), torch DDP over gloo and torch's RPC parameter server
(torch_peers_bench.py), TensorFlow's ParameterServerStrategy at 1 and at 8 steps per
dispatch (tf_ps_peer.py), and each model's one plain process on one thread. Every peer
trains the compute-bound model (784-512-512-10, batch 128, Adagrad) with 2 workers and, for
the parameter-server peers, 2 parameter-server tasks.

Per run: examples/s over the system's own timed window, and the CPU seconds every process
of the system spent in that window (cpu_meter.py: ours counts its shards, chief and
replicas, and the local supervisor of `distbelief run`), per 1,000 examples. A system's CPU
cost is that over the same figure of the same round's one plain process training the same
model: 1.0 would be distribution for free. Peer ratios are taken per round and summarised
as the median of the rounds' ratios with their min and max, so a drift of the machine
between rounds hits both sides of a ratio alike.

Before each round the bench waits (up to SETTLE_S) for the 1-minute load average to fall to
LOAD_LIMIT, and records it. A round in which any run saw more than OTHER_CORES_LIMIT cores
kept busy by other work is run again (up to ROUND_ATTEMPTS times), and its first try is
kept under "discarded" with the reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Callable

import e2e_bench
import tf_ps_peer
from cpu_meter import TreeMeter
from figures import retried, save, summarize

LOAD_LIMIT, SETTLE_S = 1.5, 120.0
OTHER_CORES_LIMIT = 0.5
ROUND_ATTEMPTS = 3
PEER_STEPS = 400  # timed steps of each torch rank; TF times twice as many, shared by its 2 workers
TIMEOUT_S = 300.0
Measure = Callable[[int], dict]


def per_thousand(examples: float, start: float, end: float, meter: TreeMeter) -> dict:
    """A run's figures from its timed window: examples/s, and its CPU per 1,000 examples."""
    used = meter.window(start, end)
    return {"examples_per_s": examples / (end - start), "cpu_s_per_1000": 1000 * used["cpu_s"] / examples,
            "cores": used["cores"], "other_cores": used["other_cores"],
            "cpu_s_per_1000_by_role": {name: 1000 * cpu / examples for name, cpu in used["cpu_s_by_role"].items()}}


def ours(name: str, workload: e2e_bench.Workload, **settings) -> Measure:
    job = e2e_bench.workload_job(name, workload, **settings)

    def run(_: int) -> dict:
        with TreeMeter() as meter:
            _, history = e2e_bench.run_job(job)
        first, last = e2e_bench.steady_window(history, workload.warmup_s)
        return per_thousand(last["examples"] - first["examples"], first["time"], last["time"], meter)
    return run


def one_process(workload: e2e_bench.Workload, job: dict) -> Measure:
    def run(_: int) -> dict:
        with TreeMeter() as meter:
            report = e2e_bench.plain_child({"spec": job["spec"], "seconds": workload.baseline_s})
        return per_thousand(report["examples"], report["start"], report["end"], meter)
    return run


def torch_peer(job: str, world: int) -> Measure:
    import torch_peers_bench  # torch is in the bench extra alone

    def run(index: int) -> dict:
        with TreeMeter() as meter:
            reports = [r for r in torch_peers_bench.launch(job, world, time.time() + TIMEOUT_S, run=index,
                                                           steps=PEER_STEPS, timeout=TIMEOUT_S) if r]
        return per_thousand(sum(r["examples"] for r in reports), min(r["start"] for r in reports),
                            max(r["end"] for r in reports), meter)
    return run


def tf_peer(dispatch: int) -> Measure:
    def run(index: int) -> dict:
        with TreeMeter() as meter:
            report = tf_ps_peer.run_cluster(dispatch, 2 * PEER_STEPS, index, TIMEOUT_S)
        return per_thousand(report["examples"], report["start"], report["end"], meter)
    return run


def systems(models: list[str]) -> dict[str, tuple[str, Measure]]:
    """Every run of a round, in the order it runs, with the model it trains: for each model
    our jobs then its one plain process; the peers after the compute-bound model's jobs."""
    out: dict[str, tuple[str, Measure]] = {}
    for model in models:
        w = e2e_bench.WORKLOADS[model]
        out[model] = model, ours(model, w)
        out[f"{model}_unencrypted"] = model, ours(model, w, encrypted=False)
        if model == "compute_bound":
            peers = {"compute_bound_every4": ours(model, dataclasses.replace(w, every=4, steps=w.steps // 4)),
                     "torch_ddp_gloo": torch_peer("ddp_examples", 2), "torch_rpc_ps": torch_peer("rpc_ps", 3),
                     "tf_ps_dispatch1": tf_peer(1), "tf_ps_dispatch8": tf_peer(8)}
            out |= {name: (model, measure) for name, measure in peers.items()}
        out[f"{model}_single_process"] = model, one_process(w, e2e_bench.workload_job(model, w))
    return out


def settle() -> float:
    """Wait for the 1-minute load average to fall to LOAD_LIMIT (at most SETTLE_S); it then."""
    deadline = time.monotonic() + SETTLE_S
    while os.getloadavg()[0] > LOAD_LIMIT and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def one_round(index: int, measures: dict[str, Measure], failures: list[dict]) -> dict:
    load = settle()
    runs = {name: retried(f"peer round {index + 1} {name}", lambda m=measure: m(index), failures)
            for name, measure in measures.items()}
    return {"load_at_start": load, "runs": runs}


def disturbed(round_: dict) -> str | None:
    """Why a round is not to be kept: a run beside which other work kept cores busy."""
    busy = {name: run["other_cores"] for name, run in round_["runs"].items() if run}
    worst = max(busy, key=busy.get, default=None)
    if worst is not None and busy[worst] > OTHER_CORES_LIMIT:
        return f"{busy[worst]:.2f} cores busy with other work beside {worst}"
    return None


def rounds(count: int, measures: dict[str, Measure], failures: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the rounds kept, the tries discarded for a disturbed machine)."""
    kept, discarded = [], []
    for index in range(count):
        for attempt in range(ROUND_ATTEMPTS):
            round_ = one_round(index, measures, failures)
            reason = disturbed(round_)
            if reason is None or attempt == ROUND_ATTEMPTS - 1:
                kept.append({**round_, "disturbed": reason})
                break
            print(f"peer round {index + 1}: run again ({reason})", file=sys.stderr, flush=True)
            discarded.append({**round_, "reason": reason})
    return kept, discarded


def figure(kept: list[dict], name: str, key: str) -> dict:
    return summarize([r["runs"][name][key] if r["runs"].get(name) else None for r in kept])


def ratio(kept: list[dict], top: Callable[[dict], float | None], bottom: Callable[[dict], float | None]) -> dict:
    """The median, min and max over rounds of a per-round ratio (rounds missing either side left out)."""
    values = []
    for r in kept:
        a, b = top(r["runs"]), bottom(r["runs"])
        values.append(None if a is None or not b else a / b)
    return summarize(values)


def value(name: str, key: str) -> Callable[[dict], float | None]:
    return lambda runs: runs[name][key] if runs.get(name) else None


def best(*names: str, key: str = "examples_per_s") -> Callable[[dict], float | None]:
    def pick(runs: dict) -> float | None:
        values = [runs[n][key] for n in names if runs.get(n)]
        return max(values) if values else None
    return pick


def cpu_costs(kept: list[dict], trained: dict[str, str]) -> dict:
    """Each system's CPU per 1,000 examples over its model's one plain process, per round."""
    return {name: ratio(kept, value(name, "cpu_s_per_1000"), value(f"{model}_single_process", "cpu_s_per_1000"))
            for name, model in trained.items() if not name.endswith("_single_process")}


def peer_ratios(kept: list[dict]) -> dict:
    eps = "examples_per_s"
    ddp, tf_best = value("torch_ddp_gloo", eps), best("tf_ps_dispatch1", "tf_ps_dispatch8")
    return {
        "distbelief_over_torch_ddp": ratio(kept, value("compute_bound", eps), ddp),
        "distbelief_unencrypted_over_torch_ddp": ratio(kept, value("compute_bound_unencrypted", eps), ddp),
        "distbelief_over_torch_rpc_ps": ratio(kept, value("compute_bound", eps), value("torch_rpc_ps", eps)),
        "distbelief_over_tf_ps_best": ratio(kept, value("compute_bound", eps), tf_best),
        "distbelief_over_tf_ps_dispatch1": ratio(kept, value("compute_bound", eps), value("tf_ps_dispatch1", eps)),
        "distbelief_cpu_over_torch_ddp_cpu": ratio(kept, value("compute_bound", "cpu_s_per_1000"),
                                                   value("torch_ddp_gloo", "cpu_s_per_1000")),
    }


def report(kept: list[dict], discarded: list[dict], trained: dict[str, str]) -> dict:
    names = list(trained)
    return {
        "examples_per_s": {n: figure(kept, n, "examples_per_s") for n in names},
        "cpu_s_per_1000": {n: figure(kept, n, "cpu_s_per_1000") for n in names},
        "busy_cores": {n: figure(kept, n, "cores") for n in names},
        "cpu_cost": cpu_costs(kept, trained),
        "ratios": peer_ratios(kept) if "compute_bound" in trained.values() else {},
        "load_at_start": [r["load_at_start"] for r in kept],
        "rounds": kept, "discarded": discarded,
    }


def printed(results: dict) -> None:
    for name, s in results["examples_per_s"].items():
        cost = results["cpu_cost"].get(name, {}).get("median")
        print(f"{name:<34} {_fmt(s, '.0f'):>24} examples/s   "
              f"{_fmt(results['cpu_s_per_1000'][name], '.3f'):>22} CPU-s/1000"
              + (f"   cost {cost:.2f}x" if cost else ""))
    for name, s in results["ratios"].items():
        print(f"{name:<40} {_fmt(s, '.2f')}")


def _fmt(s: dict, spec: str) -> str:
    return "failed" if s["median"] is None else f"{s['median']:{spec}} [{s['min']:{spec}}-{s['max']:{spec}}]"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--models", default="compute_bound,communication_bound,large_dense")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs = systems(args.models.split(","))
    failures: list[dict] = []
    kept, discarded = rounds(args.rounds, {name: measure for name, (_, measure) in runs.items()}, failures)
    results = report(kept, discarded, {name: model for name, (model, _) in runs.items()})
    printed(results)
    save({"peer_rounds": results, "failures": failures}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
