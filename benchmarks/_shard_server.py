"""One live parameter shard in its own process, for benchmarks/runtime_bench.py.

This is what `distbelief ps` runs (a `Shard` from distbelief.runtime.shard.core, serving a
ROUTER socket on loopback, single-threaded), minus the chief on shard 0 and the
Prometheus HTTP server, which would only add noise to a throughput figure. The model is
one flat tensor of --params float32 values split over --shards shards by the real
`Layout`.

Protocol with the parent: the shard's bound endpoint is printed as one line on stdout
once it serves; when stdin closes the shard stops, and one JSON line with per-request
timing splits (measured around, never inside, the runtime code) is printed.

The instrumentation wraps the socket the shard receives on (a zmq.Socket subclass
handed over through the ZeroMQ transport the Shard accepts) and the shard instance's
handler table and optimizer; no runtime file is changed.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

try:
    import distbelief.runtime.shard.core  # noqa: F401
except ImportError:  # running from a checkout without the editable install
    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "runtime")]

import numpy as np
import prometheus_client as prom
import zmq

from distbelief.runtime import keys
from distbelief.runtime.algorithms.downpour.updates import DownpourUpdates
from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.shard.core import Shard, ShardSettings
from distbelief.runtime.transport import zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.layout import Layout

perf = time.perf_counter


def minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Recorder:
    """Per-request splits; the serving loop is single-threaded, so plain fields suffice."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.current: dict = {}
        self.faults_mark = minflt()

    def summary(self) -> dict:
        out: dict[str, dict] = {}
        for op in ("PULL", "PUSH"):
            rows = [r for r in self.records if r.get("op") == op]
            if not rows:
                continue
            keys = sorted({k for r in rows for k in r if k != "op"})
            out[op] = {"count": len(rows),
                       **{k: float(np.median([r.get(k, 0.0) for r in rows])) for k in keys}}
        return out


REC = Recorder()


class TimedSocket(zmq.Socket):
    def recv_multipart(self, *args, **kwargs):  # type: ignore[override]
        started = perf()
        frames = super().recv_multipart(*args, **kwargs)
        REC.current["recv_s"] = perf() - started
        return frames

    def send_multipart(self, *args, **kwargs):  # type: ignore[override]
        started = perf()
        result = super().send_multipart(*args, **kwargs)
        REC.current["send_s"] = perf() - started
        return result


class TimedContext(zmq.Context):
    _socket_class = TimedSocket


def instrument(shard: Shard) -> None:
    handle = shard._handle

    def timed_handle(socket):
        REC.current = {}
        started = perf()
        handle(socket)
        REC.current["handle_s"] = perf() - started
        now_faults = minflt()
        # Faults since the previous request ended: includes the I/O thread's decoding of
        # this request into a fresh message buffer, which happens before poll() fires.
        REC.current["minflt"] = now_faults - REC.faults_mark
        REC.faults_mark = now_faults
        REC.records.append(REC.current)

    shard._handle = timed_handle  # type: ignore[method-assign]

    for op, handler in list(shard._handlers.items()):
        def timed_handler(message, _handler=handler, _op=op):
            REC.current["op"] = protocol.spec_of(_op).name
            started = perf()
            try:
                return _handler(message)
            finally:
                REC.current["handler_s"] = perf() - started
        shard._handlers[op] = timed_handler

    optimizer = shard.plugin(DenseSlice).optimizer
    apply = optimizer.apply

    def timed_apply(params, grad):
        started = perf()
        apply(params, grad)
        REC.current["apply_s"] = perf() - started

    optimizer.apply = timed_apply  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shard", type=int, required=True)
    parser.add_argument("--shards", type=int, required=True)
    parser.add_argument("--params", type=int, required=True)
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--sgd", action="store_true", help="plain SGD instead of Adagrad")
    parser.add_argument("--keys", default=None, metavar="DIR", help="serve with CurveZMQ, these job keys")
    parser.add_argument("--sessions", action="store_true", help="with --keys: the AES-GCM bulk channel too")
    args = parser.parse_args()
    security = keys.JobKeys.read(args.keys).server_security() if args.keys else None

    layout = Layout.of([("w", (args.params,))], shards=args.shards)
    initial = np.zeros(layout.total, dtype=np.float32)
    folder = tempfile.mkdtemp(prefix=f"db-bench-shard{args.shard}-")
    context = TimedContext()
    try:
        shard = Shard(ShardSettings(shard=args.shard, bind="tcp://127.0.0.1:*", checkpoint_dir=folder,
                                    checkpoint_every=1e9, security=security,
                                    bulk_bind="tcp://127.0.0.1:*" if args.sessions else None),
                      layout, ShardMetrics(prom.CollectorRegistry(), args.shard),
                      transport_=zmq_transport.ZmqTransport(context))
        shard.attach(DenseSlice(shard, initial, optimizer="sgd" if args.sgd else "adagrad",
                                learning_rate=args.learning_rate))
        shard.watch_updates(DownpourUpdates(shard))  # as a Downpour job's shard counts each push
        del initial
        shard.restore()
        instrument(shard)
        thread = threading.Thread(target=shard.serve, daemon=True)
        thread.start()
        if not shard.ready.wait(30):
            print("shard did not start", file=sys.stderr)
            return 1
        print(shard.endpoint, flush=True)
        sys.stdin.read()  # until the parent closes our stdin
        shard.stop()
        thread.join(timeout=60)
        print(json.dumps({"shard": args.shard, "splits": REC.summary()}), flush=True)
    finally:
        context.term()
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
