#!/usr/bin/env python
"""Do concurrent pushes tear pull replies? (See docs/benchmarks.md.)

One shard process (benchmarks/_shard_server.py, plain SGD, learning rate 1) holds
--params zeros. In each trial, --pullers replicas send a PULL and then one replica
pushes a gradient of ones. Every consistent pull therefore holds a single value
(-step). A pull that holds two values was read partly before and partly after an
update. A value that no step ever held (e.g. -4.0 between -1.0 and -2.0) is a float
whose bytes came from two different steps. Exit status 1 if any pull came back torn.

    python benchmarks/torn_pull_check.py [--params 10000000] [--pullers 4] [--trials 10]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
try:
    import distbelief.runtime.wire.protocol  # noqa: F401
except ImportError:
    sys.path[:0] = [str(HERE.parent / "runtime")]

import numpy as np
import zmq

from distbelief.runtime.params import dense
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.protocol import Header, unpack_header


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--pullers", type=int, default=4)
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    n = args.params
    server = subprocess.Popen([sys.executable, str(HERE / "_shard_server.py"), "--shard", "0", "--shards", "1",
                               "--params", str(n), "--sgd", "--learning-rate", "1"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    address = server.stdout.readline().strip()
    layout = Layout.of([("w", (n,))], shards=1)
    context = zmq.Context()
    pullers = [context.socket(zmq.DEALER) for _ in range(args.pullers)]
    pusher = context.socket(zmq.DEALER)
    for socket in (*pullers, pusher):
        socket.connect(address)
    time.sleep(0.5)
    grad = np.ones(n, dtype=np.float32)
    outs = [np.empty(n, dtype=np.float32) for _ in pullers]
    torn = 0
    try:
        for trial in range(args.trials):
            for socket in pullers:
                socket.send(Header(op=dense.PULL.code, shard=0, layout=layout.hash, seq=trial).pack())
            pusher.send_multipart([Header(op=dense.PUSH.code, shard=0, layout=layout.hash, seq=trial, count=n).pack(),
                                   dense.Update(examples=1, loss=0.0).pack(), memoryview(grad)], copy=False)
            unpack_header(pusher.recv())
            for socket, out in zip(pullers, outs):
                header = unpack_header(socket.recv())
                socket.recv_into(out)
                values, counts = np.unique(out, return_counts=True)
                if len(values) > 1:
                    torn += 1
                    # Values no step ever held: a float torn bytewise between two steps.
                    foreign = {v: c for v, c in zip(values.tolist(), counts.tolist())
                               if v not in (-float(header.step), -float(header.step + 1))}
                    print(f"trial {trial}: torn pull (header step {header.step}): "
                          f"{dict(zip(values.tolist(), counts.tolist()))}, first changed index "
                          f"{int(np.argmax(out != out[0]))}" + (f"; never-held values {foreign}" if foreign else ""))
    finally:
        for socket in (*pullers, pusher):
            socket.close(linger=0)
        context.term()
        server.stdin.close()
        server.stdout.read()
        server.wait(timeout=120)
    print(f"{torn} of {args.trials * args.pullers} pulls torn")
    return 1 if torn else 0


if __name__ == "__main__":
    sys.exit(main())
