#!/usr/bin/env python
"""Forward+backward of a 784-512-512-10 ReLU MLP at batch 128: the runtime's numpy model
against PyTorch with 1 thread, same shapes, measured alternately in one process.

    python benchmarks/mlp_step_bench.py [--runs 7] [--steps 50]

Each run times --steps back-to-back steps (after warm-up) and reports ms per step; the
figure is the median [min-max] over --runs runs. numpy's BLAS is held to 1 thread too
(OPENBLAS_NUM_THREADS=1 is set before numpy is imported) so both use one core.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "runtime")]

import numpy as np

from distbelief.runtime.model.models import Mlp

from figures import fmt, save, summarize

SHAPES = (784, (512, 512), 10)
BATCH = 128


def numpy_step(steps: int):
    model = Mlp(SHAPES[0], SHAPES[2], SHAPES[1])
    params = model.init_params(0)
    grad = np.empty_like(params)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SHAPES[0]), dtype=np.float32)
    y = rng.integers(0, SHAPES[2], BATCH)

    def run() -> float:
        t = time.perf_counter()
        for _ in range(steps):
            model.loss_and_grad(params, (x, y), out=grad)
        return (time.perf_counter() - t) / steps * 1e3
    return run


def torch_step(steps: int):
    import torch
    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                              torch.nn.ReLU(), torch.nn.Linear(512, 10))
    x = torch.randn(BATCH, 784)
    y = torch.randint(0, 10, (BATCH,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def run() -> float:
        t = time.perf_counter()
        for _ in range(steps):
            net.zero_grad(set_to_none=False)
            loss_fn(net(x), y).backward()
        return (time.perf_counter() - t) / steps * 1e3
    return run


def measure(runs: int, steps: int) -> dict:
    ours, theirs = numpy_step(steps), torch_step(steps)
    ours(), theirs()  # warm-up
    a, b = [], []
    for _ in range(runs):  # alternate so drift in load hits both alike
        a.append(ours())
        b.append(theirs())
    return {"distbelief": summarize(a), "torch": summarize(b)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = measure(args.runs, args.steps)
    for k, v in out.items():
        print(f"mlp_step_ms {k:<10} {fmt(v)}")
    print(f"ratio distbelief/torch {out['distbelief']['median'] / out['torch']['median']:.2f} (target <= 1.0)")
    save(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
