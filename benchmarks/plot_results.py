#!/usr/bin/env python
"""The figure in docs/benchmarks.md, drawn from benchmarks/results.json.

    python benchmarks/plot_results.py [benchmarks/results.json] [docs/benchmarks.png]

One panel per figure group; bars are medians, whiskers the min-max over the runs;
ours in blue, the peers and the memory limit in grey.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
PANELS = [  # (title, unit, [(label, key path)])
    ("Shard hot paths, 10M float32", "GB/s", [
        ("memcpy", ("memcpy_gbps",)), ("Adagrad apply", ("apply_gbps",)),
        ("pull, 2 shards", ("pull_gbps",)), ("push, 2 shards", ("push_gbps",))]),
    ("MLP 784-512-512-10 step, batch 128", "ms (lower is better)", [
        ("distbelief", ("mlp_step_ms", "distbelief")), ("torch", ("mlp_step_ms", "torch"))]),
    ("Training throughput, 2 replicas", "examples/s", [
        ("distbelief", ("examples_per_s", "distbelief")),
        ("unencrypted", ("examples_per_s", "distbelief_unencrypted")),
        ("torch DDP gloo", ("examples_per_s", "torch_ddp_gloo")),
        ("torch RPC PS", ("examples_per_s", "torch_rpc_ps"))]),
    ("Time to 0.95 on digits", "s (lower is better)", [
        ("downpour", ("time_to_accuracy_s", "downpour")), ("sandblaster", ("time_to_accuracy_s", "sandblaster")),
        ("one process", ("time_to_accuracy_s", "single_process")),
        ("torch DDP gloo", ("time_to_accuracy_s", "torch_ddp_gloo"))]),
    ("Parallel efficiency (1 = linear)", "job / (cores x one process)", [
        ("compute-bound", ("efficiency", "compute_bound")),
        ("communication-bound", ("efficiency", "communication_bound")),
        ("large dense", ("efficiency", "large_dense"))]),
    ("Time to 0.94, MNIST-sized", "s (lower is better)", [
        ("distbelief", ("time_to_accuracy_mnist_s", "distbelief")),
        ("one process", ("time_to_accuracy_mnist_s", "single_process")),
        ("torch DDP gloo", ("time_to_accuracy_mnist_s", "torch_ddp_gloo"))]),
    ("Operator: create to children", "s (lower is better)", [
        ("1 job", ("operator_create_to_children_s", "jobs_1")),
        ("50 jobs", ("operator_create_to_children_s", "jobs_50"))]),
]


def lookup(results: dict, path: tuple[str, ...]) -> dict | None:
    """The figure at path, or None when it is missing or no run produced it."""
    node = results
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return None
    return node if node.get("median") is not None else None


def plot(results: dict, out: str) -> None:
    columns = 3
    rows = -(-len(PANELS) // columns)
    fig, grid = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.6 * rows))
    axes = list(grid.flat)
    for ax in axes[len(PANELS):]:
        ax.set_visible(False)
    for ax, (title, unit, bars) in zip(axes, PANELS):
        found = [(label, s) for label, path in bars if (s := lookup(results, path))]
        medians = [s["median"] for _, s in found]
        errors = [[m - s["min"] for m, (_, s) in zip(medians, found)],
                  [s["max"] - m for m, (_, s) in zip(medians, found)]]
        ax.bar([label for label, _ in found], medians, yerr=errors, capsize=4,
               color=["#a0a0a0" if label.startswith(("torch", "memcpy")) else "#3b6ea5" for label, _ in found])
        for i, (m, (_, s)) in enumerate(zip(medians, found)):  # the median, above its whisker
            ax.annotate(f"{m:,.0f}" if m >= 100 else f"{m:.3g}", (i, s["max"]), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    source = Path(sys.argv[1] if len(sys.argv) > 1 else HERE / "results.json")
    out = sys.argv[2] if len(sys.argv) > 2 else str(HERE.parent / "docs" / "benchmarks.png")
    plot(json.loads(source.read_text()), out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
