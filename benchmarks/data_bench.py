#!/usr/bin/env python
"""Training data in files: what a replica's memory and input speed come to.

    python benchmarks/data_bench.py [--runs 3] [--sizes-mb 25,100] [--paths streamed,in_memory] [--json out.json]

input      one replica's StreamedBatches over local Parquet (784 float32 features, batches
           of 128, the compute-bound job's shape) with a dispenser on loopback, reading,
           shuffling and batching only (no model): examples/s and CPU microseconds per
           example (the process's CPU time: the prefetch thread's reading included)
memory     local-mode jobs (2 shards, 2 replicas, a softmax over 64 features, 10 classes)
           on Parquet sets of each size, streamed, and the same examples as one npz loaded
           whole by every pod: the replicas' peak RSS (report.json's peakRssBytes, the
           larger of the two) and the held-out accuracy each reached after the same steps

Results: data.{input_examples_per_s, input_cpu_us_per_example, peak_rss_mb, accuracy}.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from figures import save, summarize

from distbelief.operator.local import local, report
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import jobspec
from distbelief.runtime.algorithms.feed import ops
from distbelief.runtime.algorithms.feed.dispenser import Dispenser, DispenserSettings
from distbelief.runtime.algorithms.feed.stream import StreamedBatches
from distbelief.runtime.model.files import FileSet

INPUT_FEATURES, BATCH = 784, 128
MEMORY_FEATURES, CLASSES = 64, 10
ROWS_PER_FILE, ROW_GROUP = 16384, 4096


def write_set(folder: Path, *, rows: int, features: int, seed: int = 0) -> None:
    """Gaussian features labelled by a fixed linear teacher, in Parquet files of ROWS_PER_FILE."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    teacher = np.random.default_rng(99).standard_normal((features, CLASSES)).astype(np.float32)
    for k, start in enumerate(range(0, rows, ROWS_PER_FILE)):
        x = rng.standard_normal((min(ROWS_PER_FILE, rows - start), features), dtype=np.float32)
        columns = {f"f{i}": x[:, i] for i in range(features)}
        columns["y"] = np.argmax(x @ teacher, axis=1)
        pq.write_table(pa.table(columns), folder / f"part-{k:04d}.parquet", row_group_size=ROW_GROUP)


def as_npz(folder: Path, path: Path) -> None:
    """The same examples as one npz (x, y), for the path that loads them whole."""
    tables = [pq.read_table(f) for f in sorted(folder.glob("*.parquet"))]
    x = np.concatenate([np.column_stack([t.column(n).to_numpy() for n in t.column_names if n != "y"])
                        for t in tables]).astype(np.float32)
    np.savez(path, x=x, y=np.concatenate([t.column("y").to_numpy() for t in tables]))


def input_rate(folder: Path, batches: int) -> tuple[float, float]:
    """(examples/s, CPU µs per example) of one replica streaming the set, model-free."""
    file_set = FileSet(jobspec.Data(source=f"parquet:{folder}/*.parquet", test=str(folder / "part-0000.parquet")))
    stop = threading.Event()
    dispenser = Dispenser(DispenserSettings(bind="tcp://127.0.0.1:0", units=len(file_set.train_units), seed=0,
                                            layout=1), stop=stop).start()
    link = ops.DispenserLink(dispenser.endpoint, worker_id=1, layout=1, security=None, stop=stop)
    stream = StreamedBatches(file_set, link, BATCH, np.random.default_rng(0), stop=stop)
    for _ in range(20):   # the buffer's first fill
        next(stream)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next(stream)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stop.set()
    dispenser.stop()
    examples = batches * BATCH
    return examples / wall, cpu / examples * 1e6


def job_doc(source: str, steps: int) -> dict:
    return {"apiVersion": "distbelief.io/v1alpha1", "kind": "DistBeliefJob", "metadata": {"name": "databench"},
            "spec": {"model": {"type": "softmax"}, "data": {"source": source, "maxEvalExamples": 20000},
                     "training": {"batchSize": BATCH, "learningRate": 0.05, "maxSteps": steps,
                                  "evalEverySeconds": 2.0, "maxDuration": "10m"},
                     "parameterServers": {"shards": 2, "encryption": False, "checkpoint": {"everySeconds": 30}},
                     "workers": {"replicas": 2, "resources": {"limits": {"memory": "1Gi"}}}}}


def memory_run(source: str, steps: int, out: Path) -> dict:
    local.LocalRun(DistBeliefJob.validated(job_doc(source, steps)), str(out)).run(progress=False)
    summary = json.loads((out / report.REPORT_FILE).read_text())
    workers = [p["peakRssBytes"] for name, p in summary["pods"].items() if "-worker-" in name]
    return {"peak_rss_mb": max(workers) / 2**20, "accuracy": summary["accuracy"], "phase": summary["phase"]}


def measure(runs: int, sizes_mb: list[int], steps: int, work: Path, paths: list[str]) -> dict:
    input_set = work / "input"
    write_set(input_set, rows=4 * ROWS_PER_FILE + ROWS_PER_FILE, features=INPUT_FEATURES)
    rates = [input_rate(input_set, batches=2000) for _ in range(runs)]
    shutil.rmtree(input_set)
    results = {"input_examples_per_s": summarize([r for r, _ in rates]),
               "input_cpu_us_per_example": summarize([c for _, c in rates]),
               "peak_rss_mb": {"streamed": {}, "in_memory": {}}, "accuracy": {"streamed": {}, "in_memory": {}}}
    for size in sizes_mb:
        rows = size * 2**20 // (4 * MEMORY_FEATURES)
        folder = work / f"set-{size}"
        write_set(folder, rows=rows, features=MEMORY_FEATURES)
        if "in_memory" in paths:
            as_npz(folder, work / f"set-{size}.npz")
        sources = {"streamed": f"parquet:{folder}/*.parquet", "in_memory": f"npz:{work}/set-{size}.npz"}
        for path, source in ((p, sources[p]) for p in paths):
            run = memory_run(source, steps, work / f"out-{path}-{size}")
            print(f"{path} {size} MB: {run}", flush=True)
            results["peak_rss_mb"][path][f"{size}MB"] = summarize([run["peak_rss_mb"]])
            results["accuracy"][path][f"{size}MB"] = summarize([run["accuracy"]])
        shutil.rmtree(folder)
    return {"data": results}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3, help="runs of the input-speed figure")
    p.add_argument("--sizes-mb", default="25,100", help="sizes of the memory runs' sets (float32 features)")
    p.add_argument("--steps", type=int, default=3000, help="steps of each memory run")
    p.add_argument("--paths", default="streamed,in_memory",
                   help="which memory runs: streamed (parquet:) and/or in_memory (npz:, every pod loads it)")
    p.add_argument("--work", help="where the sets are written (default: a temporary folder)")
    p.add_argument("--json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="databench-", dir=args.work) as tmp:
        results = measure(args.runs, [int(s) for s in args.sizes_mb.split(",")], args.steps, Path(tmp),
                          args.paths.split(","))
    print(json.dumps(results, indent=2))
    save(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
