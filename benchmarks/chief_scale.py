#!/usr/bin/env python
"""The chief and its shard at many replicas (issue 40): the pushes shard 0 answers a second,
how long a push waits, and whether the chief still evaluates on time, as the replicas grow
from 1 to 256.

    python benchmarks/chief_scale.py [--replicas 1,16,64,256] [--seconds 8] [--clients 2]
        [--json out.json]

One process serves as shard 0's pod does: 2 Downpour shards (dense slices, Adagrad, the
replicas' figures kept by shard 0's update hook), each serving from its own thread, and the
product's chief (algorithms/chief.py) in its own thread, evaluating EVAL_EVERY seconds after
its last evaluation ended (so at most seconds / EVAL_EVERY in a window): it pulls the whole
model from both shards and scores it on the held-out set. The replicas are
threads spread over --clients processes, each with its own shard connections, pushing a
gradient and pulling the parameters back (push_and_pull) the moment the last one came, on a
model so small (874 parameters) that the messages are the whole cost: the most a replica
could ever ask of its shards. The chief's evaluations in the window, and how long each took
(pull and score), say whether many replicas delay it; the CPU of the chief's thread, of the
shards' process and of the replicas' processes say which side saturated.
"""
from __future__ import annotations

import multiprocessing
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
from sandblaster_scale import SHARDS, UNIT, problem, thread_cpu_seconds

from support.shards import start_shards

from distbelief.runtime.algorithms.chief import Chief, Score, StoppingRules, WholeModel
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.observe.metrics import ChiefMetrics
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.wire.layout import Layout

EVAL_EVERY, EVAL_EXAMPLES, EXAMPLES = 0.5, 1024, 4096
WARMUP_SECONDS = 2.0
NEVER_DONE = StoppingRules(max_steps=1 << 62)


class TimedScorer:
    """The chief's scorer, recording when each evaluation ended and how long it took."""

    def __init__(self, scorer: WholeModel) -> None:
        self.scorer, self.evaluations = scorer, []   # (ended at, seconds)

    def score(self) -> Score | None:
        started = time.perf_counter()
        score = self.scorer.score()
        self.evaluations.append((time.time(), time.perf_counter() - started))
        return score

    def save(self, path: str) -> None:
        self.scorer.save(path)

    def close(self) -> None:
        self.scorer.close()


def serve(endpoints: Any, window: Any, stop: Any) -> None:
    """Shard 0's process: the shards and the chief, until stop is set; at window's "end", the
    chief's evaluations so far go to window."""
    model, dataset = problem(EXAMPLES)
    layout = Layout.of(model.shapes, SHARDS)
    with tempfile.TemporaryDirectory(prefix="chief-scale-") as folder:
        live = start_shards(Path(folder), layout, model.init_params(0), learning_rate=0.01, checkpoint_every=3600)
        halt = threading.Event()
        group = live.group(stop=halt)
        scorer = TimedScorer(WholeModel(group, model, dataset, EVAL_EXAMPLES))
        chief = Chief(group=group, scorer=scorer, rules=NEVER_DONE, eval_every=EVAL_EVERY, output_dir=folder,
                      start_time=time.time(), metrics=ChiefMetrics(prom.CollectorRegistry()),
                      training=live.shards[0].training_figures)
        chief.start()
        (thread,) = [t for t in threading.enumerate() if t.name == "chief"]
        endpoints.put((live.addresses, thread.native_id))
        window.get()
        window.put(list(scorer.evaluations))
        stop.wait()
        halt.set()
        chief.stop()   # closes its scorer's group
        live.stop()


def push(addresses: list[str], first_id: int, replicas: int, begin: float, end: float, out: Any) -> None:
    """A client process: replicas threads pushing from begin to end (time.time()); the pushes
    answered in that window and their latencies (seconds) go to out."""
    model, _ = problem(EXAMPLES)
    layout = Layout.of(model.shapes, SHARDS)
    latencies: list[list[float]] = [[] for _ in range(replicas)]
    halt = threading.Event()

    def replica(index: int) -> None:
        group = ShardGroup(addresses, layout, worker_id=first_id + index, stop=halt,
                           timeouts=Timeouts(request=10.0, unavailable=60.0))
        client = Float32Dense(group)
        out_params, grad = np.empty(layout.total, np.float32), np.full(layout.total, 1e-4, np.float32)
        try:
            steps = [reply.step for reply in client.pull(out_params)]
            while (now := time.time()) < end:
                replies = client.push_and_pull(grad, out_params, steps=steps, examples=UNIT, loss=1.0)
                if begin <= now:
                    latencies[index].append(time.time() - now)
                steps = [reply.step for reply in replies]
        finally:
            group.close()

    threads = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put([x for per in latencies for x in per])


def measure(replicas: int, clients: int, seconds: float) -> dict:
    context = multiprocessing.get_context("spawn")
    endpoints, window, stop, out = context.Queue(), context.Queue(), context.Event(), context.Queue()
    server = context.Process(target=serve, args=(endpoints, window, stop), daemon=True)
    server.start()
    addresses, chief_tid = endpoints.get(timeout=60)
    begin = time.time() + 3.0 + WARMUP_SECONDS   # the clients' start, then a warm-up
    end = begin + seconds
    pushers = [context.Process(target=push, args=(addresses, first, share, begin, end, out), daemon=True)
               for first, share in spread(replicas, clients)]
    for process in pushers:
        process.start()
    pids = [server.pid, *(p.pid for p in pushers)]

    def cpu_at(at: float) -> np.ndarray:
        time.sleep(max(0.0, at - time.time()))
        return np.array([thread_cpu_seconds(server.pid, chief_tid), *map(cpu_seconds, pids)])

    first = cpu_at(begin)
    chief_s, server_s, *clients_s = map(float, (cpu_at(end) - first) / seconds)
    window.put("end")
    evaluations = np.array([took for ended, took in window.get(timeout=30) if begin <= ended - took and ended <= end])
    latencies = np.array([x for _ in pushers for x in out.get(timeout=120)])
    for process in pushers:
        process.join(timeout=60)
    stop.set()
    server.join(timeout=60)
    return {"replicas": replicas, "pushes_per_s": round(latencies.size / seconds, 1),
            "push_ms_p50": round(float(np.percentile(latencies, 50)) * 1e3, 2),
            "push_ms_p99": round(float(np.percentile(latencies, 99)) * 1e3, 2),
            "evaluations": int(evaluations.size), "evaluations_at_most": int(seconds / EVAL_EVERY),
            "evaluation_ms_p50": round(float(np.median(evaluations)) * 1e3, 1) if evaluations.size else None,
            "evaluation_ms_max": round(float(evaluations.max()) * 1e3, 1) if evaluations.size else None,
            "chief_cores": round(chief_s, 3), "shards_process_cores": round(server_s, 2),
            "replicas_cores": round(sum(clients_s), 2)}


def main() -> int:
    return run_counts(__doc__, "chief_scale", lambda replicas, args: measure(replicas, args.clients, args.seconds))


if __name__ == "__main__":
    raise SystemExit(main())
