#!/usr/bin/env python
"""Every benchmark in one run, merged into one results file, with the target ratios.

    python benchmarks/run_all.py [--json benchmarks/results.json]

Runs benchmarks/runtime_bench.py (memcpy, apply, pull, push) and
benchmarks/mlp_step_bench.py, then merges their keys into --json, keeping other keys.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_json(script: str, *args: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        subprocess.run([sys.executable, str(HERE / script), *args, "--json", str(out)], check=True)
        return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=str(HERE / "results.json"))
    args = p.parse_args()
    path = Path(args.json)
    results = json.loads(path.read_text()) if path.exists() else {}
    results.update(run_json("runtime_bench.py", "--repeats", "5", "--params", "10000000"))
    results["mlp_step_ms"] = run_json("mlp_step_bench.py", "--runs", "7")
    path.write_text(json.dumps(results, indent=2) + "\n")
    med = {k: results[k]["median"] for k in ("memcpy_gbps", "apply_gbps", "pull_gbps", "push_gbps")}
    ratios = {
        "apply/memcpy (>= 0.35)": med["apply_gbps"] / med["memcpy_gbps"],
        "pull/memcpy (>= 0.2)": med["pull_gbps"] / med["memcpy_gbps"],
        "push/memcpy (>= 0.2)": med["push_gbps"] / med["memcpy_gbps"],
        "mlp step distbelief/torch (<= 1.0)": results["mlp_step_ms"]["distbelief"]["median"]
        / results["mlp_step_ms"]["torch"]["median"],
    }
    for name, value in ratios.items():
        print(f"{name:<40} {value:.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
