#!/usr/bin/env python
"""Model-parallel replicas: what each pod holds and moves, the pipeline's cost, and the
largest model that trains under a per-pod memory limit.

    python benchmarks/partition_bench.py [--runs 3] [--what pods|accuracy|limit|all] [--micro-batches M]
                                         [--json out.json]

Figures (merged into --json under "partitions"):

  pods.N{1,2,4}          one replica of the 2000-2500-2500-2500-2500-10 MLP (23.8M
                         parameters, 95 MB) over 4 shards, as 1, 2 or 4 partitions (local
                         mode, encryption on, batch 32, fetchEvery = pushEvery = 1):
                         every worker pod's peakRssBytes and bytes moved per step
                         ((bytesIn + bytesOut) / globalStep), from report.json; with
                         --micro-batches M, N = 2 and 4 split each minibatch into M
                         micro-batches (spec.model.microBatches)
  updates_per_s.N{1,2,4} the job's steady global steps per second (history.jsonl, after a
                         warm-up), beside single_process: the same model, batch and
                         optimizer in one plain process on one thread
  accuracy.N{1,2}        held-out accuracy at the end of examples/digits-partitioned.yaml
                         (mlp 64-32, 2 shards, 3 replicas, 8000 steps) as shipped
                         (partitions: 2) and with partitions: 1
  limit                  under resources.limits.memory 2Gi for every pod, the widest
                         1000-W-W-W-W-10 MLP (W from WIDTHS) whose job completes MAX_STEPS
                         steps, unpartitioned and with 4 partitions over 4 shards, and the
                         first W that does not (with the pod that was OOMKilled)

Two cores run every process of a job here, so the updates/s figures show mostly what the
pipeline costs: at most two of a replica's stages (and its shards) can compute at once.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from figures import RunFailed, interleaved, save, summarize

import e2e_bench
from distbelief.operator.local import local, report
from distbelief.operator.validation.job import DistBeliefJob

HIDDEN, FEATURES = [2500, 2500, 2500, 2500], 2000
SOURCE = f"synthetic:features={FEATURES},classes=10,samples=2048,seed=1"
SHARDS, BATCH, STEPS = 4, 32, 60
WIDTHS = [4000, 6000, 8000, 10000, 12000]
LIMIT, LIMIT_STEPS = "2Gi", 3


def job(name: str, partitions: int, hidden: list[int], features: int, *, steps: int, memory: str,
        micro_batches: int = 1) -> dict:
    doc = yaml.safe_load((HERE.parent / "examples" / "digits-mlp.yaml").read_text())
    doc["metadata"]["name"] = name
    s = doc["spec"]
    s["model"] = {"type": "mlp", "hiddenLayers": hidden, "activation": "relu", "partitions": partitions}
    if partitions > 1:
        s["model"]["microBatches"] = micro_batches
    s["data"] = {"source": f"synthetic:features={features},classes=10,samples=512,seed=1"
                 if features != FEATURES else SOURCE, "testFraction": 0.1, "maxEvalExamples": 128}
    s["training"].update({"batchSize": BATCH, "fetchEvery": 1, "pushEvery": 1, "maxSteps": steps,
                          "evalEverySeconds": 2.0, "maxDuration": "30m"})
    s["parameterServers"]["shards"], s["workers"]["replicas"] = SHARDS, 1
    s["parameterServers"]["checkpoint"]["everySeconds"] = 3600
    for role in (s["parameterServers"], s["workers"]):
        role["resources"]["limits"]["memory"] = memory
    return doc


def run(doc: dict, folder: Path) -> tuple[int, dict, list[dict]]:
    """(exit code, report.json, the chief's history) of one local run."""
    code = local.LocalRun(DistBeliefJob.validated(doc), str(folder)).run(progress=False)
    summary = json.loads((folder / report.REPORT_FILE).read_text())
    history = next(folder.glob("volumes/*-ps-0/checkpoints/history.jsonl"), None)  # none if ps-0 died first
    lines = [json.loads(line) for line in history.read_text().splitlines()] if history else []
    return code, summary, lines


def steady_steps_per_s(history: list[dict], warmup_s: float) -> float:
    warm = [h for h in history if h["elapsed"] >= warmup_s]
    if len(warm) < 2:
        raise RunFailed(f"{len(warm)} evaluation(s) after {warmup_s} s: no rate", None)
    return (warm[-1]["step"] - warm[0]["step"]) / (warm[-1]["time"] - warm[0]["time"])


def measure_pods(runs: int, failures: list[dict], micro_batches: int = 1) -> dict:
    def one(partitions: int):
        def measure(_: int) -> dict:
            with tempfile.TemporaryDirectory() as tmp:
                code, summary, history = run(job(f"pods-n{partitions}", partitions, HIDDEN, FEATURES, steps=STEPS,
                                                 memory="4Gi", micro_batches=micro_batches), Path(tmp))
            if code != 0:
                raise RunFailed(f"partitions={partitions}: {summary.get('reason')}", code)
            steps = summary["globalStep"]
            pods = {name: {"peakRssBytes": p["peakRssBytes"], "bytesPerStep": (p["bytesIn"] + p["bytesOut"]) / steps}
                    for name, p in summary["pods"].items()}
            return {"pods": pods, "updates_per_s": steady_steps_per_s(history, warmup_s=6.0)}
        return measure
    values = interleaved(runs, {f"N{n}": one(n) for n in (1, 2, 4)}, failures, what="partitions ")
    single = [e2e_bench.baseline_rate(job("plain", 1, HIDDEN, FEATURES, steps=1, memory="4Gi")["spec"], 10.0) / BATCH
              for _ in range(runs)]
    return {"micro_batches": micro_batches, "pods": {n: _median_pods([v for v in vs if v]) for n, vs in values.items()},
            "updates_per_s": {**{n: summarize([v["updates_per_s"] for v in vs if v]) for n, vs in values.items()},
                              "single_process": summarize(single)}}


def _median_pods(runs: list[dict]) -> dict:
    """Each worker and shard pod's figures, the median over runs (pods named alike across runs)."""
    names = runs[0]["pods"] if runs else {}
    return {name: {key: summarize([r["pods"][name][key] for r in runs if name in r["pods"]])
                   for key in ("peakRssBytes", "bytesPerStep")} for name in names}


def measure_accuracy(runs: int, failures: list[dict]) -> dict:
    """The partitioned digits example's final held-out accuracy, and the same job unpartitioned."""
    def one(partitions: int):
        def measure(_: int) -> float:
            doc = yaml.safe_load((HERE.parent / "examples" / "digits-partitioned.yaml").read_text())
            doc["spec"]["model"]["partitions"] = partitions
            with tempfile.TemporaryDirectory() as tmp:
                code, summary, _ = run(doc, Path(tmp))
            if code != 0:
                raise RunFailed(f"digits, partitions={partitions}: {summary.get('reason')}", code)
            return summary["accuracy"]
        return measure
    values = interleaved(runs, {f"N{n}": one(n) for n in (1, 2)}, failures, what="digits accuracy ")
    return {name: summarize(v) for name, v in values.items()}


def measure_limit(failures: list[dict]) -> dict:
    """The widest model each way trains under LIMIT, and the first that does not."""
    found: dict = {}
    for partitions in (1, 4):
        fits, fails = None, None
        for width in WIDTHS:
            doc = job(f"limit-n{partitions}", partitions, [width] * 4, 1000, steps=LIMIT_STEPS, memory=LIMIT)
            doc["spec"]["runPolicy"]["backoffLimit"] = 0
            with tempfile.TemporaryDirectory() as tmp:
                started = time.monotonic()
                code, summary, _ = run(doc, Path(tmp))
            params = 1000 * width + 3 * width * width + 10 * width + 4 * width + 10
            outcome = {"width": width, "params": params, "seconds": round(time.monotonic() - started, 1),
                       "maxPeakRssBytes": max(p["peakRssBytes"] for p in summary["pods"].values()),
                       "oomKilled": [n for n, p in summary["pods"].items() if p.get("oomKills")]}
            print(f"limit N={partitions} W={width}: exit {code} {outcome}", flush=True)
            if code != 0:
                fails = {**outcome, "reason": summary.get("reason")}
                break
            fits = outcome
        found[f"N{partitions}"] = {"largest_that_trains": fits, "first_that_does_not": fails}
    return {"memory_limit": LIMIT, "steps": LIMIT_STEPS, **found}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--what", choices=["pods", "accuracy", "limit", "all"], default="all")
    p.add_argument("--micro-batches", type=int, default=1, help="spec.model.microBatches of the N > 1 pods jobs")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    failures: list[dict] = []
    results: dict = {}
    if args.what in ("pods", "all"):
        results.update(measure_pods(args.runs, failures, args.micro_batches))
    if args.what in ("accuracy", "all"):
        results["accuracy"] = measure_accuracy(args.runs, failures)
    if args.what in ("limit", "all"):
        results["limit"] = measure_limit(failures)
    print(json.dumps(results, indent=2))
    save({"partitions": results, "failures": failures}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
