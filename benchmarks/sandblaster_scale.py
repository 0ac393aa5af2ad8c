#!/usr/bin/env python
"""Sandblaster's coordinator at many replicas (issue 40): the L-BFGS evaluations a second and
the work units handed out, as the replicas grow from 1 to 256, and which side saturates.

    python benchmarks/sandblaster_scale.py [--replicas 1,16,64,256] [--seconds 8] [--clients 2]
        [--json out.json]

One process serves as shard 0's pod does: 2 shards (dense slices with Sandblaster's vectors,
each serving from its own thread) and the coordinator in its own thread. The replicas are
real Sandblaster replicas (algorithms/sandblaster/replica.py), threads spread over --clients
processes, each with its own shard connections and coordinator link, training a model so
small that the messages are the whole cost: an MLP of 16 features, 32 tanh units and 10
classes (874 parameters) memorising random labels, which L-BFGS keeps improving on through
any window (its tolerances are set never to stop it). The batch is UNITS_PER_REPLICA units
of 64 examples per replica of the largest count, the same at every count, so every replica
has work in each evaluation. Per unit a replica asks the coordinator, computes the unit's
gradient and adds it to every shard; per evaluation it pulls the trial point once, and the
coordinator sends its vector commands to every shard and each shard commits the iteration.
The units handed out count backup copies (of units not back yet when the rest are done,
DistBelief's answer to stragglers). The CPU of the coordinator's thread (from
/proc/<pid>/task), of the shards' process and of the replicas' processes over the window
say which saturated.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import prometheus_client as prom

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from dispenser_scale import cpu_seconds, run_counts, spread

from support.shards import start_vector_shards

from distbelief.runtime import errors, jobspec
from distbelief.runtime.algorithms.sandblaster.coordinator import Coordinator, CoordinatorSettings
from distbelief.runtime.algorithms.sandblaster.lbfgs import LbfgsSettings
from distbelief.runtime.algorithms.sandblaster.replica import CoordinatorLink, Replica
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.model import models
from distbelief.runtime.model.data import Dataset
from distbelief.runtime.contract import Metric
from distbelief.runtime.observe.metrics import CoordinatorMetrics, WorkerMetrics
from distbelief.runtime.wire.layout import Layout

FEATURES, CLASSES, UNIT, UNITS_PER_REPLICA, SHARDS, HISTORY = 16, 10, 64, 4, 2, 5
WARMUP_SECONDS = 2.0
NEVER_DONE = LbfgsSettings(history=HISTORY, gradient_tolerance=-1.0, objective_tolerance=-1.0)
COUNTED = (Metric.SANDBLASTER_EVALUATIONS, "distbelief_sandblaster_units", "distbelief_sandblaster_backup_units")


def problem(examples: int) -> tuple[models.Model, Dataset]:
    """An MLP memorising random labels: tiny, so each unit costs its messages, and far from
    done for thousands of iterations."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((examples, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, examples)
    model = models.build_model(jobspec.Model(type="mlp", hidden_layers=(32,), activation="tanh"), FEATURES, CLASSES)
    return model, Dataset(x_train=x, y_train=y, x_test=x[:1], y_test=y[:1], n_classes=CLASSES)


def serve(examples: int, endpoints: Any, window: Any, stop: Any) -> None:
    """The shards' and coordinator's process: serve until stop is set; the coordinator's
    evaluations and units at the window's two ends go to window."""
    model, _ = problem(examples)
    layout = Layout.of(model.shapes, SHARDS)
    initial = model.init_params(0)
    halt = threading.Event()
    with tempfile.TemporaryDirectory(prefix="sandblaster-scale-") as folder:
        shards = start_vector_shards(Path(folder), layout, initial, HISTORY).shards
        registry = prom.CollectorRegistry()
        metrics = CoordinatorMetrics(registry)
        settings = CoordinatorSettings(bind="tcp://127.0.0.1:*", examples=examples, unit_size=UNIT,
                                       max_iterations=10**9, lbfgs=NEVER_DONE)
        coordinator = Coordinator(settings, group_of([s.endpoint for s in shards], layout, halt), metrics, stop=halt)
        coordinator.start()
        (thread,) = [t for t in threading.enumerate() if t.name == "coordinator"]
        endpoints.put(([s.endpoint for s in shards], coordinator.endpoint, thread.native_id))
        for _ in range(2):   # the window's start, then its end
            window.get()
            window.put(tuple(registry.get_sample_value(f"{name}_total") for name in COUNTED))
        stop.wait()
        halt.set()
        for shard in shards:
            shard.stop()


def group_of(endpoints: list[str], layout: Layout, stop: threading.Event, worker_id: int | None = None) -> ShardGroup:
    return ShardGroup(endpoints, layout, worker_id=worker_id, timeouts=Timeouts(request=5.0, unavailable=60.0),
                      stop=stop)


def work(examples: int, shard_endpoints: list[str], coordinator: str, first_id: int, replicas: int,
         end: float) -> None:
    """A client process: replicas threads of Sandblaster replicas, until end (time.time())."""
    model, dataset = problem(examples)
    layout = Layout.of(model.shapes, SHARDS)
    halt = threading.Event()

    def replica(index: int) -> None:
        group = group_of(shard_endpoints, layout, halt, worker_id=first_id + index)  # the coordinator's name for it too
        link = CoordinatorLink(coordinator, worker_id=group.worker_id, layout=layout.hash, security=None, stop=halt)
        try:
            Replica(group, link, model, dataset, WorkerMetrics(prom.CollectorRegistry()), stop=halt).run()
        except errors.Stopped:
            pass
        finally:
            group.close()

    threads = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(replicas)]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, end - time.time()))
    halt.set()
    for thread in threads:
        thread.join(timeout=30)


def thread_cpu_seconds(pid: int, tid: int) -> float:
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(replicas: int, clients: int, seconds: float, examples: int) -> dict:
    context = multiprocessing.get_context("spawn")
    endpoints, window, stop = context.Queue(), context.Queue(), context.Event()
    server = context.Process(target=serve, args=(examples, endpoints, window, stop), daemon=True)
    server.start()
    shard_endpoints, coordinator, coordinator_tid = endpoints.get(timeout=60)
    begin = time.time() + 3.0 + WARMUP_SECONDS   # the clients' start, then a warm-up
    end = begin + seconds
    workers = [context.Process(target=work, args=(examples, shard_endpoints, coordinator, first, share, end + 1.0),
                               daemon=True)
               for first, share in spread(replicas, clients)]
    for process in workers:
        process.start()
    pids = [server.pid, *(p.pid for p in workers)]

    def sample(at: float, mark: str) -> np.ndarray:
        """At time `at`: the coordinator's counts, its thread's CPU seconds, every process's."""
        time.sleep(max(0.0, at - time.time()))
        window.put(mark)
        counts = window.get(timeout=30)
        return np.array([*counts, thread_cpu_seconds(server.pid, coordinator_tid), *map(cpu_seconds, pids)])

    first = sample(begin, "begin")
    evaluations, units, backups, coordinator_s, shards_s, *replicas_s = (sample(end, "end") - first) / seconds
    for process in workers:
        process.join(timeout=60)
    stop.set()
    server.join(timeout=60)
    return {"replicas": replicas, "units_per_evaluation": examples // UNIT,
            "evaluations_per_s": round(evaluations, 2), "units_per_s": round(units, 1),
            "backup_units_per_s": round(backups, 1), "coordinator_cores": round(coordinator_s, 2),
            "shards_process_cores": round(shards_s, 2), "replicas_cores": round(sum(replicas_s), 2)}


def main() -> int:
    def at(replicas: int, args: Any) -> dict:
        examples = UNITS_PER_REPLICA * max(args.replicas) * UNIT   # the same batch at every count
        return measure(replicas, args.clients, args.seconds, examples)
    return run_counts(__doc__, "sandblaster_scale", at)


if __name__ == "__main__":
    raise SystemExit(main())
