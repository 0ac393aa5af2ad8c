#!/usr/bin/env python
"""Resharding a dense job's checkpoints (issue 39): the time of `distbelief reshard`'s work
on a folder of 90M parameters with Adagrad's accumulators, 2 -> 3 and 4 -> 2 shards,
against the time to write and then read one checkpoint of every shard (the target: under
2x). Synthetic checkpoints in a local output folder's layout; the re-cut, staging, plan and
moves are the product's (operator/local/resharding.py), fsyncs included.

    python benchmarks/reshard_bench.py [--params 90000000] [--runs 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time

import numpy as np

from distbelief.operator.local import outputdir, resharding
from distbelief.operator.local.localpods import volume_dir
from distbelief.operator.validation import spec
from distbelief.runtime import contract
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.wire.layout import Layout
from figures import summarize

CASES = ((2, 3), (4, 2))


def config_of(shards: int) -> contract.JobConfig:
    """A job's config for the folder's names; the layout comes from the synthetic model."""
    doc = {"apiVersion": contract.JOB_API_VERSION, "kind": contract.KIND, "metadata": {"name": "bench"},
           "spec": {"model": {"type": "mlp", "hiddenLayers": [8]}, "data": {"source": "builtin:digits"},
                    "training": {"optimizer": "adagrad"}, "parameterServers": {"shards": shards}}}
    return spec.job_config(spec.validate_job(doc))


def write_checkpoints(output: str, names: contract.JobNames, layout: Layout, rng: np.random.Generator) -> float:
    """Every shard's checkpoint of layout, written into output: the seconds it took."""
    states = [{"params": rng.standard_normal(layout.size(s), dtype=np.float32),
               "adagrad_accumulator": rng.random(layout.size(s), dtype=np.float32)} for s in range(layout.shards)]
    started = time.perf_counter()
    for shard, arrays in enumerate(states):
        folder = volume_dir(output, names.shard_pod(shard), contract.CHECKPOINT_VOLUME)
        checkpoint.save(folder, checkpoint.Checkpoint(step=1000, layout=layout.hash, shard=shard, arrays=arrays,
                                                      meta={"optimizer": "adagrad"}), keep=2)
    return time.perf_counter() - started


def read_checkpoints(output: str, names: contract.JobNames, shards: int) -> float:
    started = time.perf_counter()
    for shard in range(shards):
        assert outputdir.newest(volume_dir(output, names.shard_pod(shard), contract.CHECKPOINT_VOLUME))
    return time.perf_counter() - started


def one_run(params: int, before: int, after: int, seed: int) -> dict[str, float]:
    shapes = [("w", (params // 1000, 1000))]
    config = config_of(after)
    with tempfile.TemporaryDirectory(prefix="reshard-bench-") as output:
        os.sync()   # each timing starts with no other write in flight
        written = write_checkpoints(output, config.names, Layout.of(shapes, before), np.random.default_rng(seed))
        os.sync()
        read = read_checkpoints(output, config.names, before)
        started = time.perf_counter()
        done = resharding.reshard(output, config, Layout.of(shapes, after))
        resharded = time.perf_counter() - started
        assert done is not None and (done.before, done.after) == (before, after)
        shutil.rmtree(output, ignore_errors=True)
    return {"write_s": written, "read_s": read, "reshard_s": resharded,
            "ratio": resharded / (written + read)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=90_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results: dict[str, dict] = {}
    for before, after in CASES:
        runs = [one_run(args.params, before, after, seed) for seed in range(args.runs)]
        key = f"{before}->{after}"
        results[key] = {name: summarize([run[name] for run in runs]) for name in runs[0]}
        figures = results[key]
        print(f"{key} shards, {args.params:,} parameters + Adagrad: reshard {figures['reshard_s']['median']:.2f} s, "
              f"write {figures['write_s']['median']:.2f} s + read {figures['read_s']['median']:.2f} s, "
              f"ratio {figures['ratio']['median']:.2f} (target < 2)", flush=True)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = {"reshard": {"params": args.params, "cases": results, "peak_rss_mib": round(peak_mib)}}
    print(f"peak resident memory {peak_mib:,.0f} MiB")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
