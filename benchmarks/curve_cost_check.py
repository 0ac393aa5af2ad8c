#!/usr/bin/env python
"""What authenticated encryption costs per message, against plain ZeroMQ over the same
loopback TCP, at the sizes our shards send: CurveZMQ (the handshake of every encrypted
job), and an AES-256-GCM session over a plain socket (what an encrypted job's bulk
channel does with parameters and gradients: distbelief.runtime.transport.sessions).

    python benchmarks/curve_cost_check.py [--messages 500]

One PAIR socket pair in one process sends float32 arrays to itself with recv_into (the
session: sealed, then opened into the array), so the CPU figure covers both ends:
encrypting and decrypting, or copying.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import zmq

from distbelief.runtime.transport import framing, sessions

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


def sealed_transfer(client: zmq.Socket, server: zmq.Socket, size: int):
    """One message as the bulk channel sends it: sealed, sent, opened into the array."""
    ends = [sessions.Session(id=bytes(sessions.ID_BYTES), key=bytes(range(sessions.KEY_BYTES))) for _ in range(2)]
    received = memoryview(np.empty(size, np.float32)).cast("B")
    pool, head = framing.BufferPool(keep=1), framing.HEAD.size + framing.LENGTH.size

    def transfer(sent: np.ndarray) -> None:
        data, buffer = ends[0].seal_into(sessions.TO_SERVER, [memoryview(sent)], pool)
        client.send(data)  # copied: the buffer goes back to the pool now
        pool.release(buffer)
        message = server.recv(copy=False).buffer
        prefix = bytes(message[:sessions.PREFIX.size])
        counter = ends[1].counter_of(prefix)
        ends[1].open(sessions.TO_SERVER, prefix, counter, 0, 1, message[head:], into=received)
        ends[1].accept(counter)
    return transfer


def per_message(mode: str, size: int, messages: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per message, after a warm-up; mode: plain, curve or session."""
    context = zmq.Context()
    server, client = pair(context, mode == "curve")
    sent, received = np.ones(size, np.float32), np.empty(size, np.float32)

    def copied(array: np.ndarray) -> None:
        client.send(array, copy=False)
        server.recv_into(received)
    transfer = sealed_transfer(client, server, size) if mode == "session" else copied
    for _ in range(5):
        transfer(sent)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(messages):
        transfer(sent)
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
        for mode in ("plain", "curve", "session"):
            wall, cpu = per_message(mode, size, args.messages)
            print(f"{label:<46} {mode:<7} {wall:6.2f} ms wall  {cpu:6.2f} ms CPU  "
                  f"{size * 4 / wall / 1e6:5.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
