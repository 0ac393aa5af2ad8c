#!/usr/bin/env python
"""The data dispenser at many replicas (issue 40): how many NEXT_UNIT asks a second one
dispenser answers, and how long an ask waits, as the replicas asking grow from 1 to 256.

    python benchmarks/dispenser_scale.py [--replicas 1,16,64,256] [--seconds 8] [--clients 2]
        [--json out.json]

The dispenser (algorithms/feed/dispenser.py) runs in a process of its own, serving from its
own thread and ROUTER socket as it does beside shard 0. The replicas are threads spread over
--clients processes, each with its own DispenserLink (a DEALER socket, as a replica has),
asking for the next unit the moment the last one came and finishing it at once: the most a
replica could ever ask. A real replica asks once per unit it trains through, so the asks a
second a job needs are its replicas times their examples/s over a unit's examples; the
capacity measured here divided by that is how many replicas one dispenser can feed. The CPU
seconds of the dispenser's process and of the clients' over the window say which side
saturated.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
from figures import save

from distbelief.runtime.algorithms.feed import ops
from distbelief.runtime.algorithms.feed.dispenser import Dispenser, DispenserSettings
from distbelief.runtime.wire.protocol import Status

UNITS = 1 << 20        # never all out at once: every ask can be given a unit
WARMUP_SECONDS = 1.0


def cpu_seconds(pid: int) -> float:
    """The user and system time of process pid, every thread of it."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(endpoints: Any, stop: Any) -> None:
    """The dispenser's process: serve until stop is set."""
    dispenser = Dispenser(DispenserSettings(bind="tcp://127.0.0.1:*", units=UNITS, seed=1, layout=0),
                          stop=threading.Event()).start()
    endpoints.put(dispenser.endpoint)
    stop.wait()
    dispenser.stop()


def ask(endpoint: str, first_id: int, replicas: int, begin: float, end: float, out: Any) -> None:
    """A client process: replicas threads asking from begin to end (time.time()); the asks
    answered in that window and their latencies (seconds) go to out."""
    latencies: list[list[float]] = [[] for _ in range(replicas)]
    halt = threading.Event()

    def replica(index: int) -> None:
        link = ops.DispenserLink(endpoint, worker_id=first_id + index, layout=0, security=None, stop=halt)
        finished, epoch = ops.NONE, 0
        try:
            while (now := time.time()) < end:
                status, given = link.ask(ops.UnitAsk(finished=finished, epoch=epoch, want=1))
                if begin <= now:
                    latencies[index].append(time.time() - now)
                finished, epoch = (given.unit, given.epoch) if status == Status.OK and given else (ops.NONE, 0)
        finally:
            link.close()

    threads = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put([x for per in latencies for x in per])


def spread(replicas: int, clients: int) -> list[tuple[int, int]]:
    """Replica threads over client processes: each process's first replica number and count."""
    shares = [len(part) for part in np.array_split(np.arange(replicas), min(clients, replicas))]
    return [(int(first), share) for first, share in zip(np.cumsum([0, *shares[:-1]]), shares)]


def measure(replicas: int, clients: int, seconds: float) -> dict:
    context = multiprocessing.get_context("spawn")
    endpoints, stop, out = context.Queue(), context.Event(), context.Queue()
    server = context.Process(target=serve, args=(endpoints, stop), daemon=True)
    server.start()
    endpoint = endpoints.get(timeout=60)
    begin = time.time() + 3.0 + WARMUP_SECONDS   # the clients' start, then a warm-up
    end = begin + seconds
    askers = [context.Process(target=ask, args=(endpoint, first, share, begin, end, out), daemon=True)
              for first, share in spread(replicas, clients)]
    for process in askers:
        process.start()
    time.sleep(max(0.0, begin - time.time()))
    pids = [server.pid, *(p.pid for p in askers)]
    before = [cpu_seconds(pid) for pid in pids]   # type: ignore[arg-type]
    time.sleep(max(0.0, end - time.time()))
    after = [cpu_seconds(pid) for pid in pids]    # type: ignore[arg-type]
    latencies = np.array([x for _ in askers for x in out.get(timeout=120)])
    for process in askers:
        process.join(timeout=60)
    stop.set()
    server.join(timeout=60)
    used = [(a - b) / seconds for a, b in zip(after, before)]
    return {"replicas": replicas, "asks_per_s": round(latencies.size / seconds, 1),
            "ask_ms_p50": round(float(np.percentile(latencies, 50)) * 1e3, 3),
            "ask_ms_p99": round(float(np.percentile(latencies, 99)) * 1e3, 3),
            "dispenser_cores": round(used[0], 2), "clients_cores": round(sum(used[1:]), 2)}


def scale_arguments(doc: str) -> argparse.Namespace:
    """The options of a bench of one role against 1 to 256 replica threads (this one's,
    sandblaster_scale.py's and chief_scale.py's); --replicas as a list of counts."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--replicas", default="1,16,64,256")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--clients", type=int, default=2, help="processes the replica threads are spread over")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.replicas = [int(n) for n in args.replicas.split(",")]
    return args


def run_counts(doc: str, key: str, measure: Callable[[int, argparse.Namespace], dict]) -> int:
    """A scale bench's main: measure(replicas, args) at each count of --replicas, each row
    printed as it comes, all of them saved under key in --json."""
    args = scale_arguments(doc)
    rows = []
    for replicas in args.replicas:
        rows.append(measure(replicas, args))
        print(rows[-1], flush=True)
    save({key: rows}, args.json)
    return 0


def main() -> int:
    return run_counts(__doc__, "dispenser_scale", lambda replicas, args: measure(replicas, args.clients, args.seconds))


if __name__ == "__main__":
    raise SystemExit(main())
