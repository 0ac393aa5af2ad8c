#!/usr/bin/env python
"""Resharding a job's checkpoints (issue 39): the time of `distbelief reshard`'s work, 2 -> 3
and 4 -> 2 shards, against the time to write and then read one checkpoint of every shard
(the target: under 2x), for
- a dense job of 90M parameters with Adagrad's accumulators;
- the 800M-parameter embedding table: 50M rows x 16 with their Adagrad accumulators,
  written as the shards write a table that size (a base file of rows, named by the
  checkpoint) and read as a restore reads it.
Synthetic checkpoints in a local output folder's layout; the re-cut, staging, plan and
moves are the product's (runtime/roles/reshard.py, over a local folder's places),
fsyncs included.

    python benchmarks/reshard_bench.py [--params 90000000] [--rows 50000000] [--runs 3] [--json FILE]
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
from distbelief.runtime.params.rows.rowcheckpoint import RowCheckpoints, saved_parts
from distbelief.runtime.params.rows.rowtable import RowTable
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.rowkeys import owner_of
from figures import summarize

CASES = ((2, 3), (4, 2))
ROW_DIM, ROWS_DENSE = 16, [("w", (1000, 16))]  # the embedding job's dense part: small beside its rows


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


def write_row_checkpoints(output: str, names: contract.JobNames, layout: Layout, rows: int,
                          rng: np.random.Generator) -> float:
    """Every shard's checkpoint of an embedding job with `rows` rows in all, each row on the
    shard its key hashes to, written as the shard writes it: the seconds it took."""
    keys = np.arange(rows, dtype=np.int64)
    owners = owner_of(keys, layout.shards)
    took = 0.0
    for shard in range(layout.shards):
        mine = keys[owners == shard]
        table = RowTable(ROW_DIM, learning_rate=0.05, seed=1)
        table.load(mine, rng.standard_normal((mine.size, ROW_DIM), dtype=np.float32),
                   rng.random(mine.size, dtype=np.float32), np.full(mine.size, 1.7e9))
        folder = volume_dir(output, names.shard_pod(shard), contract.CHECKPOINT_VOLUME)
        started = time.perf_counter()
        arrays, meta = RowCheckpoints(table, folder, shard=shard, layout=layout.hash).state(1000)
        arrays.update({"params": np.zeros(layout.size(shard), np.float32),
                       "adagrad_accumulator": np.zeros(layout.size(shard), np.float32)})
        checkpoint.save(folder, checkpoint.Checkpoint(step=1000, layout=layout.hash, shard=shard, arrays=arrays,
                                                      meta={**meta, "sparseDim": ROW_DIM, "sparseWide": 0}), keep=2)
        took += time.perf_counter() - started
        del table, arrays
    return took


def read_checkpoints(output: str, names: contract.JobNames, shards: int) -> float:
    """Every shard's newest checkpoint read and checked as a restore does, rows included."""
    started = time.perf_counter()
    for shard in range(shards):
        folder = volume_dir(output, names.shard_pod(shard), contract.CHECKPOINT_VOLUME)
        ckpt = outputdir.newest(folder)
        assert ckpt is not None
        if "sparseDim" in ckpt.meta:
            assert sum(rows[0].size for rows, _ in saved_parts(ckpt, folder, ROW_DIM))
    return time.perf_counter() - started


def one_run(size: int, before: int, after: int, seed: int, *, rows: bool) -> dict[str, float]:
    """One reshard of `size` dense parameters, or of `size` embedding rows beside a small
    dense part, timed against writing and reading one checkpoint set."""
    shapes = ROWS_DENSE if rows else [("w", (size // 1000, 1000))]
    config = config_of(after)
    with tempfile.TemporaryDirectory(prefix="reshard-bench-") as output:
        os.sync()   # each timing starts with no other write in flight
        rng = np.random.default_rng(seed)
        if rows:
            written = write_row_checkpoints(output, config.names, Layout.of(shapes, before), size, rng)
        else:
            written = write_checkpoints(output, config.names, Layout.of(shapes, before), rng)
        os.sync()
        read = read_checkpoints(output, config.names, before)
        started = time.perf_counter()
        done = resharding.reshard_output(output, config, Layout.of(shapes, after))
        resharded = time.perf_counter() - started
        assert done is not None and (done.before, done.after) == (before, after)
        shutil.rmtree(output, ignore_errors=True)
    return {"write_s": written, "read_s": read, "reshard_s": resharded,
            "ratio": resharded / (written + read)}


def cases(size: int, runs: int, *, rows: bool) -> dict[str, dict]:
    results: dict[str, dict] = {}
    what = f"{size:,} embedding rows x {ROW_DIM} + Adagrad" if rows else f"{size:,} parameters + Adagrad"
    for before, after in CASES:
        done = [one_run(size, before, after, seed, rows=rows) for seed in range(runs)]
        key = f"{before}->{after}"
        results[key] = {name: summarize([run[name] for run in done]) for name in done[0]}
        figures = results[key]
        print(f"{key} shards, {what}: reshard {figures['reshard_s']['median']:.2f} s, "
              f"write {figures['write_s']['median']:.2f} s + read {figures['read_s']['median']:.2f} s, "
              f"ratio {figures['ratio']['median']:.2f} (target < 2)", flush=True)
    return results


def peak_mib() -> int:
    """This process's peak resident memory so far."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=90_000_000)
    parser.add_argument("--rows", type=int, default=50_000_000, help="embedding rows of 16 (0: none)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = {"reshard": {"params": args.params, "cases": cases(args.params, args.runs, rows=False),
                          "peak_rss_mib": peak_mib()}}
    if args.rows:
        report["reshard"].update({"rows": args.rows, "row_cases": cases(args.rows, args.runs, rows=True),
                                  "row_peak_rss_mib": peak_mib()})
    print(f"peak resident memory {report['reshard']['peak_rss_mib']:,} MiB dense, "
          f"{report['reshard'].get('row_peak_rss_mib', 0):,} MiB with the rows")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
