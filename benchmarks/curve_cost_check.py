#!/usr/bin/env python
"""What CurveZMQ (every job's transport: authenticated and encrypted) costs per message,
against plain ZeroMQ over the same loopback TCP, at the sizes our shards send.

    python benchmarks/curve_cost_check.py [--messages 500]

One PAIR socket pair in one process sends float32 arrays to itself with recv_into, so
the CPU figure covers both ends: encrypting and decrypting with CURVE, copying without.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import zmq

SIZES = {"64 KB": 16_000, "1.3 MB (a shard's slice of the benchmark MLP)": 335_000}


def pair(context: zmq.Context, curve: bool) -> tuple[zmq.Socket, zmq.Socket]:
    server, client = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    if curve:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        server.curve_server, server.curve_secretkey, server.curve_publickey = True, server_secret, server_public
        client.curve_serverkey, client.curve_publickey, client.curve_secretkey = server_public, client_public, client_secret
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.connect(f"tcp://127.0.0.1:{port}")
    return server, client


def per_message(curve: bool, size: int, messages: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per message, after a warm-up."""
    context = zmq.Context()
    server, client = pair(context, curve)
    sent, received = np.ones(size, np.float32), np.empty(size, np.float32)
    for _ in range(5):
        client.send(sent, copy=False)
        server.recv_into(received)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(messages):
        client.send(sent, copy=False)
        server.recv_into(received)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    server.close(0)
    client.close(0)
    context.term()
    return wall / messages * 1e3, cpu / messages * 1e3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--messages", type=int, default=500)
    args = p.parse_args()
    for label, size in SIZES.items():
        for curve in (False, True):
            wall, cpu = per_message(curve, size, args.messages)
            print(f"{label:<46} {'curve' if curve else 'plain':<6} {wall:6.2f} ms wall  {cpu:6.2f} ms CPU  "
                  f"{size * 4 / wall / 1e6:5.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
