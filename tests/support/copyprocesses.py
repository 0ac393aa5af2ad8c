"""Copies of one shard (spec.parameterServers.backups) as processes on loopback, each killed
with SIGKILL and started again on its own folder, as a pod is; and replicas whose every push
can be recognised in the shard's parameters (SGD at learning rate 1: push i moves
coordinate i by 1, so the final parameter i counts the applications of push i)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import prometheus_client as prom

from distbelief.runtime import errors
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.params import dense
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.copies import forwarding, replication
from distbelief.runtime.shard.copies.kubeapi import KubeApi
from distbelief.runtime.shard.copies.kubelease import LeaseViewStore
from distbelief.runtime.shard.copies.viewstore import FileViewStore, ViewRecord, ViewStore
from distbelief.runtime.shard.copies.watch import COPY_STATUS, PRIMARY
from distbelief.runtime.shard.core import Shard, ShardSettings
from distbelief.runtime.transport import fanout, interface, zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.layout import Layout

from support.ports import free_port

VALUES = 16384          # push ids: coordinates of the shard's slice
SLOW_PART_VALUES = 32   # a catch-up in 512 parts, one at a time: the seconds a large state takes
LEASE_SECONDS = 1.5


def layout() -> Layout:
    return Layout.of([("w", (VALUES,))], shards=1)


class LeaseAt(NamedTuple):
    """A shard's view in a Lease on a real API server (kubelease.py), as the copies reach it."""
    server: str
    token: str
    ca_file: str
    namespace: str
    name: str = "copies-shard-0"


def view_store(at: str | LeaseAt) -> ViewStore:
    """The copies' view store: a file's path, or a Lease."""
    if isinstance(at, str):
        return FileViewStore(at)
    api = KubeApi(at.server, token=at.token, ca_file=at.ca_file)
    return LeaseViewStore(api, namespace=at.namespace, name=at.name)


def _serve_copy(rank: int, addresses: list[str], folder: str, store: str | LeaseAt, checkpoint_every: float,
                ready: Any) -> None:
    """A copy's process: the shard serves until SIGTERM (a final checkpoint) or SIGKILL."""
    logging.basicConfig(filename=os.path.join(folder, f"copy-{rank}.log"), level=logging.INFO,
                        format=f"%(asctime)s pid={os.getpid()} %(levelname)s %(name)s %(message)s")
    dense.PART_VALUES, forwarding.PARTS_WINDOW_BYTES = SLOW_PART_VALUES, 1
    settings = ShardSettings(shard=0, bind=addresses[rank], checkpoint_dir=os.path.join(folder, f"copy-{rank}"),
                             checkpoint_every=checkpoint_every)
    shard = Shard(settings, layout(), ShardMetrics(prom.CollectorRegistry(), 0))
    shard.attach(DenseSlice(shard, np.zeros(VALUES, np.float32), optimizer="sgd", learning_rate=1.0))
    shard.serve_copies(replication.Copies(shard, rank=rank, addresses=addresses, security=None,
                                          store=view_store(store), lease_seconds=LEASE_SECONDS))
    shard.restore()
    signal.signal(signal.SIGTERM, lambda *_: shard.stop())
    threading.Thread(target=lambda: shard.ready.wait() and ready.set(), daemon=True).start()
    shard.serve()


class CopyProcesses:
    """The copies of shard 0, copy r serving at addresses[r] from folder/copy-r; their view in
    folder/views (local mode's store), or in a Lease."""

    def __init__(self, folder: Path, count: int = 3, checkpoint_every: float = 1.0, lease: LeaseAt | None = None) -> None:
        self.folder, self.checkpoint_every = folder, checkpoint_every
        self.addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(count)]
        self.store_at: str | LeaseAt = lease or str(folder / "views" / "shard-0.json")
        self.store = view_store(self.store_at)
        self.processes: list[Any] = [None] * count
        self._context = multiprocessing.get_context("spawn")

    def start(self, rank: int) -> None:
        ready = self._context.Event()
        process = self._context.Process(target=_serve_copy, daemon=True, args=(
            rank, self.addresses, str(self.folder), self.store_at, self.checkpoint_every, ready))
        process.start()
        assert ready.wait(60), f"copy {rank} did not start"
        self.processes[rank] = process

    def kill(self, rank: int) -> None:
        """SIGKILL: no final checkpoint, no lease given back, what was queued to send is lost."""
        process = self.processes[rank]
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        self.processes[rank] = None

    def stop(self) -> None:
        """SIGTERM to every copy alive: each writes its final checkpoint."""
        for process in self.processes:
            if process is not None:
                process.terminate()
        for process in self.processes:
            if process is not None:
                process.join(30)

    def record(self) -> ViewRecord | None:
        return self.store.read()[0]

    def status(self, rank: int) -> dict | None:
        """Copy rank's COPY_STATUS (role, view, step, incarnation), or None if it does not answer."""
        transport = zmq_transport.default()
        link = transport.link(self.addresses[rank], None, watch=False)
        try:
            link.send([protocol.Header(op=COPY_STATUS.code, shard=0, layout=layout().hash).pack()])
            if not transport.wait([link], 1.0):
                return None
            received = link.receive()
            return protocol.JsonObject.unpack(received.frames[0]).value if received and received.frames else None
        finally:
            link.close()

    def in_sync(self) -> bool:
        """One copy leads with every copy, as it is now, in its in-sync set."""
        record = self.record()
        states = [self.status(rank) if process is not None else None for rank, process in enumerate(self.processes)]
        if record is None or None in states:
            return False
        members = {(rank, state["incarnation"]) for rank, state in enumerate(states)}
        return states[record.primary]["role"] == PRIMARY and set(record.in_sync) == members

    def newest_checkpoints(self) -> dict[int, checkpoint.Checkpoint]:
        """Each copy's newest checkpoint (a copy that wrote none is left out)."""
        found = {rank: checkpoint.list_checkpoints(str(self.folder / f"copy-{rank}"))
                 for rank in range(len(self.processes))}
        return {rank: checkpoint.load(paths[0]) for rank, paths in found.items() if paths}


class Pushes:
    """Replicas pushing push ids index, index + count, ... each; every push in the history
    (benchmarks/copyverdict.py's Op: when it began and ended, whether it was acknowledged, the
    step its acknowledgement carried)."""

    def __init__(self, copies: CopyProcesses, op: type, clients: int = 3) -> None:
        self.copies, self.op, self.clients = copies, op, clients
        self.history: list[Any] = []
        self.stopping, self.give_up = threading.Event(), threading.Event()
        self.threads = [threading.Thread(target=self._push, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> Pushes:
        for thread in self.threads:
            thread.start()
        return self

    def acknowledged(self, after: float = 0.0) -> int:
        return sum(1 for op in list(self.history) if op.acked and op.end > after)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(120)
        self.give_up.set()
        for thread in self.threads:
            thread.join(30)

    def _push(self, index: int) -> None:
        group = ShardGroup([self.copies.addresses], layout(), timeouts=Timeouts(request=1.0, unavailable=120.0),
                           stop=self.give_up)
        try:
            for i in range(index, VALUES, self.clients):
                if self.stopping.is_set():
                    return
                op = self.op(id=i, start=time.monotonic())
                self.history.append(op)
                grad = np.zeros(VALUES, np.float32)
                grad[i] = -1.0
                try:
                    [reply] = Float32Dense(group).push(grad, steps=[0], examples=1, loss=0.0)
                    op.steps, op.acked = [reply.step], True
                except errors.RuntimeFailure as exc:  # stopped, or no copy answered for minutes
                    op.error = str(exc)
                    return
                finally:
                    op.end = time.monotonic()
        finally:
            group.close()


def push_as_one_peer(link: interface.Link, seq: int, push_id: int) -> protocol.Header:
    """Push push_id as the link's one peer (its routing id) under seq, sent on to the next copy
    on a refusal or a silence as a replica's link does; the header of the reply that took it.
    The same seq again is a resend, as a replica that lost the reply sends it."""
    grad = np.zeros(VALUES, np.float32)
    grad[push_id] = -1.0
    request = [protocol.Header(op=dense.PUSH.code, shard=0, layout=layout().hash, seq=seq, worker=7,
                               count=VALUES).pack(), dense.Update(examples=1, loss=0.0).pack(), grad.tobytes()]
    taken: list[protocol.Header] = []

    def accept(_: int, received: interface.Received) -> bool | str:
        header = protocol.unpack_header(received.header)
        if header.seq != seq:
            return False  # the answer to an earlier push
        if header.status == protocol.Status.ERROR and header.error == protocol.ErrorCode.NOT_PRIMARY:
            return fanout.REDIRECT
        taken.append(header)
        return True

    policy = fanout.RetryPolicy(attempt=1.0, give_up=60.0)
    fanout.exchange(zmq_transport.default(), fanout.Exchange([link], [request], policy, ["shard 0"]), accept=accept,
                    stop=threading.Event())
    return taken[0]


def final_verdict(copies: CopyProcesses, pushes: Pushes, verdict: Any) -> tuple[dict, dict]:
    """Stop the copies and judge the pushes' history by what the primary holds (verdict:
    benchmarks/copyverdict.py's); the verdict, and the figures a failure should show."""
    counts, step = applied_counts(copies)
    copies.stop()
    judged = verdict(pushes.history, counts[None, :], [step], limit=counts.size)
    return judged, {k: judged[k] for k in ("acknowledged", "indeterminate", "lost", "duplicated", "phantom", "went_back",
                                           "steps", "applied")}


def applied_counts(copies: CopyProcesses) -> tuple[np.ndarray, int]:
    """How many times each push id was applied, as the primary's parameters say, and its step."""
    group = ShardGroup([copies.addresses], layout(), timeouts=Timeouts(request=1.0, unavailable=60.0))
    try:
        params = np.empty(VALUES, np.float32)
        [reply] = Float32Dense(group).pull(params)
    finally:
        group.close()
    return np.rint(params).astype(np.int64), reply.step
