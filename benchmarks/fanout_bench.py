#!/usr/bin/env python
"""The fan-out cost of a push: one replica's push_and_pull against 1 to 64 shards (issue 40).

    python benchmarks/fanout_bench.py [--shards 1,4,16,64] [--params 65536,4194304] [--pushes 200]
        [--json out.json]

Shards serve in threads of this process on loopback (tests/support/shards.py: Downpour's
dense slices, Adagrad, unencrypted), one client pushes a gradient and pulls the parameters
back --pushes times through the product's ShardGroup and Float32Dense. For each model size
the time per push_and_pull against the shard count gives the cost each shard adds to a
push: the bytes are the same at every count, the messages are one per shard. The shards
and the client share the process, so each shard's handling is counted in full (on a cluster
the shards run it on their own cores and a replica pays only its own side).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from figures import save, summarize

from support.shards import start_shards
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.wire.layout import Layout

WARMUP = 10


def seconds_per_push(shards: int, params: int, pushes: int) -> float:
    """Median seconds of one push_and_pull of `params` float32 values over `shards` shards."""
    layout = Layout.of([("w", (params,))], shards=shards)
    with tempfile.TemporaryDirectory() as tmp:
        live = start_shards(Path(tmp), layout, np.zeros(params, np.float32), learning_rate=0.01,
                            checkpoint_every=3600)
        group = live.group()
        try:
            client = Float32Dense(group)
            out, grad = np.empty(params, np.float32), np.full(params, 1e-3, np.float32)
            steps = [reply.step for reply in client.pull(out)]
            times = []
            for push in range(WARMUP + pushes):
                started = time.perf_counter()
                replies = client.push_and_pull(grad, out, steps=steps, examples=1, loss=0.0)
                if push >= WARMUP:
                    times.append(time.perf_counter() - started)
                steps = [reply.step for reply in replies]
        finally:
            group.close()
            live.stop()
    return float(np.median(times))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", default="1,4,16,64")
    p.add_argument("--params", default="65536,4194304")
    p.add_argument("--pushes", type=int, default=200)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    counts = [int(k) for k in args.shards.split(",")]
    results: dict[str, dict] = {}
    for params in (int(n) for n in args.params.split(",")):
        by_count = {k: summarize([seconds_per_push(k, params, args.pushes) * 1e3 for _ in range(args.runs)])
                    for k in counts}
        slope = np.polyfit(counts, [by_count[k]["median"] for k in counts], 1)[0]
        results[str(params)] = {"ms_per_push": {str(k): v for k, v in by_count.items()},
                                "ms_per_added_shard": float(slope)}
        print(f"{params:>9} parameters: " + "  ".join(f"{k} shards {v['median']:.2f} ms" for k, v in by_count.items())
              + f"  -> {slope:.3f} ms per added shard", flush=True)
    save({"fanout": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
