#!/usr/bin/env python
"""Bounded staleness: what tau costs and buys when one replica is slow.

    python benchmarks/staleness_bench.py [--runs 3] [--json out.json]

Three replicas train the digits MLP (64 hidden, Adagrad lr 0.01, batch 32) against two
live shards in this process (real ZeroMQ on loopback); one replica sleeps 2x its own
compute time after each minibatch, so it runs about 3x slower. For tau (maxStaleness) in
{0, 1, 4, unbounded} the figures (median, min, max over --runs), under "staleness_tau":

  wasted_fraction   gradient slices computed but not applied (a shard found its slice
                    staler than tau) / slices pushed, over all replicas: the replicas' share
                    of work thrown away. With the refetch design a replica never waits, so
                    this is its idle time.
  slow_wasted_fraction  the same for the slow replica alone
  steps_to_target   global steps (shard 0's) at the first held-out accuracy >= TARGET
  seconds_to_target wall seconds to it

The chief's evaluation is replaced by a thread that pulls and scores every EVAL_S.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import prometheus_client as prom

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from figures import save, summarize

from conftest import start_shards
from distbelief.runtime import errors, jobspec
from distbelief.runtime.algorithms.downpour.worker import Worker
from distbelief.runtime.model import data, models
from distbelief.runtime.observe.metrics import WorkerMetrics
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.wire.layout import Layout

TARGET, EVAL_S, TIMEOUT_S, SLOWDOWN = 0.97, 0.1, 120.0, 3.0
SHARDS, LEARNING_RATE = 2, 0.01
TAUS = {"0": 0, "1": 1, "4": 4, "unbounded": None}


class Slowed:
    """A model whose gradient takes SLOWDOWN times as long (it sleeps the difference)."""

    def __init__(self, model: models.Model) -> None:
        self._model, self.shapes = model, model.shapes

    def loss_and_grad(self, params, batch, out=None):
        started = time.perf_counter()
        result = self._model.loss_and_grad(params, batch, out)
        time.sleep((SLOWDOWN - 1) * (time.perf_counter() - started))
        return result


def one_run(tau: int | None, seed: int) -> dict:
    dataset = data.load(jobspec.Data(source="builtin:digits", test_fraction=0.2, seed=0))
    model = models.build_model(jobspec.Model(type="mlp", hidden_layers=(64,)), dataset.n_features, dataset.n_classes)
    layout = Layout.of(model.shapes, shards=SHARDS)
    with tempfile.TemporaryDirectory() as tmp:
        live = start_shards(Path(tmp), layout, model.init_params(seed), learning_rate=LEARNING_RATE, checkpoint_every=3600)
        for shard in live.shards:
            shard.plugin(DenseSlice).max_staleness = tau
        stop = threading.Event()
        workers = [Worker(jobspec.Training(batch_size=32), live.group(stop=stop),
                          Slowed(model) if i == 2 else model, dataset, WorkerMetrics(prom.CollectorRegistry()),
                          seed=seed * 10 + i, stop=stop) for i in range(3)]
        threads = [threading.Thread(target=_run, args=(w,), daemon=True) for w in workers]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        try:
            step, seconds = _until_target(live, model, dataset, started)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=10)
            live.stop()
    stale = [w.metrics.stale._value.get() for w in workers]  # one per shard that refused a push
    wasted = [s / max(1, w.steps * SHARDS) for s, w in zip(stale, workers)]
    return {"wasted_fraction": sum(stale) / max(1, SHARDS * sum(w.steps for w in workers)),
            "slow_wasted_fraction": wasted[2], "steps_to_target": step, "seconds_to_target": seconds}


def _run(worker: Worker) -> None:
    try:
        worker.run()
    except errors.Stopped:
        pass


def _until_target(live, model, dataset, started: float) -> tuple[int | None, float | None]:
    group = live.group()
    params = np.empty(live.layout.total, np.float32)
    try:
        while time.monotonic() - started < TIMEOUT_S:
            replies = Float32Dense(group).pull(params)
            if models.evaluate(model, params, dataset.x_test, dataset.y_test)[1] >= TARGET:
                return replies[0].step, time.monotonic() - started
            time.sleep(EVAL_S)
        return None, None
    finally:
        group.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs = {name: [one_run(tau, seed) for seed in range(args.runs)] for name, tau in TAUS.items()}
    results = {name: {key: summarize([r[key] for r in rs if r[key] is not None]) for key in rs[0]}
               for name, rs in runs.items()}
    for name, figures in results.items():
        print(f"tau={name:<9} " + "  ".join(f"{k}={v['median']}" for k, v in figures.items()), flush=True)
    save({"staleness_tau": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
