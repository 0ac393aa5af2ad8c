#!/usr/bin/env python
"""Every benchmark in one run, merged into one results file and one plot, with the target ratios.

    python benchmarks/run_all.py [--json benchmarks/results.json] [--plot docs/benchmarks.png] [--runs 5]

Runs, in this order, each in its own process: runtime_bench.py (memcpy, apply, pull,
push), mlp_step_bench.py, e2e_bench.py (our jobs in local mode), torch_peers_bench.py
(DDP gloo and an RPC parameter server) and operator_bench.py. Their keys are merged into
--json, keeping any other keys; every figure is a median with its min and max.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = [  # (label, numerator, denominator, lowest or highest allowed, "min" | "max")
    ("apply / memcpy", ("apply_gbps",), ("memcpy_gbps",), 0.35, "min"),
    ("pull / memcpy", ("pull_gbps",), ("memcpy_gbps",), 0.2, "min"),
    ("push / memcpy", ("push_gbps",), ("memcpy_gbps",), 0.2, "min"),
    ("MLP step distbelief / torch", ("mlp_step_ms", "distbelief"), ("mlp_step_ms", "torch"), 1.0, "max"),
    ("examples/s distbelief / torch RPC PS", ("examples_per_s", "distbelief"), ("examples_per_s", "torch_rpc_ps"),
     1.0, "min"),
    ("examples/s distbelief / torch DDP gloo", ("examples_per_s", "distbelief"),
     ("examples_per_s", "torch_ddp_gloo"), 0.8, "min"),
    # The peers encrypt nothing; this is the like-for-like comparison (encryption: false).
    ("examples/s unencrypted / torch RPC PS", ("examples_per_s", "distbelief_unencrypted"),
     ("examples_per_s", "torch_rpc_ps"), 1.0, "min"),
    ("examples/s unencrypted / torch DDP gloo", ("examples_per_s", "distbelief_unencrypted"),
     ("examples_per_s", "torch_ddp_gloo"), 0.8, "min"),
]


def run_json(script: str, *args: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        started = time.monotonic()
        subprocess.run([sys.executable, str(HERE / script), *args, "--json", str(out)], check=True)
        print(f"{script}: {time.monotonic() - started:.0f} s", flush=True)
        return json.loads(out.read_text())


def median(results: dict, path: tuple[str, ...]) -> float:
    node = results
    for key in path:
        node = node[key]
    return node["median"]


def target_ratios(results: dict) -> list[dict]:
    rows = []
    for label, num, den, bound, kind in TARGETS:
        ratio = median(results, num) / median(results, den)
        met = ratio >= bound if kind == "min" else ratio <= bound
        rows.append({"figure": label, "ratio": ratio, "target": f"{'>=' if kind == 'min' else '<='} {bound}",
                     "met": met})
    return rows


def measure(runs: int) -> dict:
    results = run_json("runtime_bench.py", "--repeats", str(runs), "--params", "10000000")
    results["mlp_step_ms"] = run_json("mlp_step_bench.py", "--runs", str(max(runs, 7)))
    ours = run_json("e2e_bench.py", "--runs", str(runs))
    peers = run_json("torch_peers_bench.py", "--what", "all", "--runs", str(runs))
    for key in ("examples_per_s", "time_to_accuracy_s"):
        results[key] = {**ours[key], **peers[key]}
    results["operator_create_to_children_s"] = run_json("operator_bench.py", "--runs", str(runs))[
        "operator_create_to_children_s"]
    results["peer_metadata"] = peers.get("metadata", {})
    return results


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=str(HERE / "results.json"))
    p.add_argument("--plot", default=str(HERE.parent / "docs" / "benchmarks.png"))
    p.add_argument("--runs", type=int, default=5, help="runs per figure (at least 5 for the published figures)")
    args = p.parse_args()
    path = Path(args.json)
    results = json.loads(path.read_text()) if path.exists() else {}
    results.update(measure(args.runs))
    results["targets"] = target_ratios(results)
    path.write_text(json.dumps(results, indent=2) + "\n")
    for row in results["targets"]:
        print(f"{row['figure']:<42} {row['ratio']:6.2f}  target {row['target']:<7} {'met' if row['met'] else 'MISSED'}")
    from plot_results import plot  # matplotlib only after the measurements
    plot(results, args.plot)
    print(f"wrote {path} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
