#!/usr/bin/env python
"""The 800M-parameter embedding table: memory of 50M rows x 16 over 4 shard processes.

    python benchmarks/sparse_table_bench.py [--rows 50000000] [--dim 16] [--shards 4] [--json FILE]

Starts --shards shard processes (this file with --serve: a Shard with the SparseRows plugin,
serving ZeroMQ on loopback, as `distbelief ps` does, minus the chief and the HTTP server;
unencrypted), then fills their tables through the real SPARSE_PUSH handler: this process
pushes --rows distinct keys, in deduplicated batches of keys_per_request(dim) keys, with
random row gradients, so every row is created by its push and gets one row-wise Adagrad
update, each on the shard that owns its key. Then it reads, from /proc:

  rss_bytes_total     the shards' resident memory (VmRSS) summed, after the fill
  peak_rss_bytes_total    their peak resident memory (VmHWM) summed
  idle_rss_bytes_total    their resident memory before the fill (interpreter, numpy, ZeroMQ)
  bytes_per_row       (rss_bytes_total - idle_rss_bytes_total) / rows
  params              rows x dim, the rows the shards report holding (checked, not assumed)
  fill_rows_per_s     rows created per second by the fill, end to end

and pulls a sample of the keys back to check they hold trained rows, not initial values.
Merged into --json under "sparse" beside sparse_bench.py's figures. One run: it takes
minutes and ~5 GB of memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import prometheus_client as prom

from distbelief.runtime.client.group import ShardGroup
from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.params.rows.row_client import RowClient
from distbelief.runtime.params.rows.rowtable import initial_rows
from distbelief.runtime.params.rows.sparse import SparseRows, keys_per_request
from distbelief.runtime.shard.core import Shard, ShardSettings
from distbelief.runtime.wire.layout import Layout

SEED, LEARNING_RATE = 7, 0.05
_ODD = np.uint64(0x9E3779B97F4A7C15)
_KEY_MASK = np.uint64((1 << 63) - 1)


def layout(shards: int) -> Layout:
    """A job whose dense part is negligible: the table is the model."""
    return Layout.of([("w", (shards,))], shards=shards)


def distinct_keys(numbers: np.ndarray) -> np.ndarray:
    """Distinct numbers as keys spread over the 63-bit space: x * odd mod 2**63 is one-to-one."""
    return ((numbers.astype(np.uint64) * _ODD) & _KEY_MASK).astype(np.int64)


def serve(index: int, shards: int, dim: int) -> int:
    """One shard process: print its endpoint, serve until stdin closes, print its table's size."""
    with tempfile.TemporaryDirectory(prefix=f"db-table-shard{index}-") as folder:
        shard = Shard(ShardSettings(shard=index, bind="tcp://127.0.0.1:*", checkpoint_dir=folder,
                                    checkpoint_every=1e9),
                      layout(shards), ShardMetrics(prom.CollectorRegistry(), index))
        plugin = SparseRows(shard, dim=dim, learning_rate=LEARNING_RATE, seed=SEED)
        shard.attach(plugin)
        threading.Thread(target=shard.serve, daemon=True).start()
        if not shard.ready.wait(30):
            return 1
        print(shard.endpoint, flush=True)
        sys.stdin.read()
        print(json.dumps({"rows": plugin.table.n, "table_bytes": plugin.table.nbytes()}), flush=True)
    os._exit(0)  # no final checkpoint: the figure is memory, and a 1 GB write per shard is not


def memory(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def fill(client: RowClient, rows: int, dim: int) -> float:
    """Push rows distinct keys through SPARSE_PUSH; the rows created per second."""
    batch = keys_per_request(dim) * client.group.layout.shards  # each shard gets about one request's worth
    grads = np.random.default_rng(0).standard_normal((batch, dim)).astype(np.float32)
    started = time.perf_counter()
    for start in range(0, rows, batch):
        keys = distinct_keys(np.arange(start, min(rows, start + batch)))
        client.push(keys, grads[: keys.size])
    return rows / (time.perf_counter() - started)


def measure(rows: int, dim: int, shards: int) -> dict:
    script = str(Path(__file__).resolve())
    procs = [subprocess.Popen([sys.executable, script, "--serve", str(i), "--shards", str(shards), "--dim", str(dim)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(shards)]
    try:
        endpoints = [p.stdout.readline().strip() for p in procs]  # type: ignore[union-attr]
        if not all(endpoints):
            raise RuntimeError("a shard process did not start")
        idle = sum(memory(p.pid)[0] for p in procs)
        group = ShardGroup(endpoints, layout(shards))
        client = RowClient(group, dim)
        rate = fill(client, rows, dim)
        after = [memory(p.pid) for p in procs]
        sample = distinct_keys(np.arange(0, rows, max(1, rows // 1000)))
        pulled, _ = client.pull(sample)
        trained = float(np.mean(np.any(pulled != initial_rows(sample, dim, SEED), axis=1)))
        group.close()
        reports = []
        for p in procs:
            p.stdin.close()  # type: ignore[union-attr]
            reports.append(json.loads(p.stdout.readline()))  # type: ignore[union-attr]
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    held = sum(r["rows"] for r in reports)
    if held != rows or trained < 1.0:
        raise RuntimeError(f"the shards hold {held} rows of the {rows} pushed; {trained:.1%} of a sample trained")
    rss = sum(r for r, _ in after)
    return {
        "params": held * dim,
        "rows": held,
        "dim": dim,
        "shards": shards,
        "rss_bytes_total": rss,
        "peak_rss_bytes_total": sum(h for _, h in after),
        "idle_rss_bytes_total": idle,
        "rss_bytes_per_shard": [r for r, _ in after],
        "table_bytes_total": sum(r["table_bytes"] for r in reports),
        "bytes_per_row": (rss - idle) / held,
        "fill_rows_per_s": rate,
        "definition_table": (f"{held} rows x {dim} over {shards} shard processes, filled through SPARSE_PUSH "
                             f"from one unencrypted loopback client; RSS from /proc after the fill"),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=50_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.serve is not None:
        return serve(args.serve, args.shards, args.dim)
    results = measure(args.rows, args.dim, args.shards)
    print(json.dumps(results, indent=2))
    if args.json:
        path = Path(args.json)
        merged = json.loads(path.read_text()) if path.exists() else {}
        merged["sparse"] = {**merged.get("sparse", {}), **results}
        path.write_text(json.dumps(merged, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
