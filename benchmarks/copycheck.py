#!/usr/bin/env python
"""A Jepsen-style checker of shard copies (spec.parameterServers.backups): a local-mode job
pushed to by checker clients whose every push can be recognised in the shards' final
parameters, while a seeded nemesis injects faults into and between the copies; then a
verdict (copyverdict.py).

    python benchmarks/copycheck.py [--runs 8] [--seconds 30] [--seed 1] [--json out.json]

The pushes. The job trains with SGD at learning rate 1 and no clipping (maxGradientNorm far
above 1) and no replicas of its own; each checker client says HELLO and pushes. Push id i's
gradient is -1 at coordinate i of every shard's slice and 0 elsewhere, so a shard's final
parameter i minus its initial one is how many times push i was applied there (with
Plan.optimizer "adagrad", read through Adagrad's steps: applications()). A client pushes
with the steps of its last acknowledgement, as a replica with those it pulled, so that a
shard counts what it lost (shard/losses.py) and the run compares that with what was lost. With
embeddings ("sparse") a push first sends the row of key i (every value -1) to the shard
that owns it, then the dense push; SGD moves the row by 1 for each application too. A push is acknowledged when every shard
answered it (the client's ShardGroup sends it again to a shard's next copy as a replica
does); one whose client stopped waiting is indeterminate. A partitioned job's shards hold
gradients until their step commits ("partitioned"): each push is HELD on every shard and
then committed as partition 0 commits a step (PREPARE_HELD, then APPLY_HELD or DROP_HELD);
it is acknowledged when applied, refused when dropped, and must be applied on every shard
or on none.

The faults (Nemesis), on one copy of a shard or between two (with backups: 2, sometimes
on two copies at once), and one unkind schedule ("backup-then-primary": a backup killed,
then the primary Plan.kill_gap seconds later, whatever the first kill left in sync; the
plans of --unkind run it at minInSync 1 and 2, and at gaps within and beyond the 1.5-3 s a
primary takes to drop a dead backup): SIGKILL (local mode restarts the pod with back-off), SIGSTOP for
1-10 s then SIGCONT, the copies' traffic delayed 50-500 ms, a one-way partition for 1-10
s (held, then healed or cut), and the connections cut. Copies reach each other through
netfault.py proxies (DISTBELIEF_COPY_ROUTES), their AES-GCM sessions' bulk traffic
too; clients reach the copies directly. A fault
begins only when every copy of its shard is in sync again, so at most `backups` copies of
a shard are faulty at once, a copy catching up counting as faulty; unless Plan.anytime
(unkind), when a fault comes every few seconds whatever the copies' state.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "operator"), str(HERE.parent / "runtime")]

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

import copyverdict
import netfault
import storefault
from copyverdict import Op
from distbelief.operator.local import local
from distbelief.operator.local.localpods import VIEWS_FOLDER, LocalPod, volume_dir
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract, errors, keys
from distbelief.runtime.algorithms.pipeline.commit import Commit, new_token
from distbelief.runtime.algorithms.pipeline.ops import HOLD, Held
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.params.rows.row_client import RowClient
from distbelief.runtime.params.rows.rowcheckpoint import keys_from_parts
from distbelief.runtime.roles.common import FAILOVER_ATTEMPT_SECONDS, Job
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.copies.replication import LEASE_SECONDS
from distbelief.runtime.wire.protocol import Status

PRIMARY = 2  # distbelief_copy_role
FAULTS = ("kill", "stall", "delay", "partition", "cut")   # and, asked by name: "backup-then-primary", "store"
ROW_DIM = 4
SETTLE_SECONDS = 180.0  # at the end, for every shard's copies to be in sync again
READ_PAUSE_SECONDS = 0.2  # between the reader's pulls


@dataclasses.dataclass(frozen=True)
class Plan:
    kind: str = "dense"          # or "sparse" (embedding rows too), or "partitioned" (held steps)
    backups: int = 1
    seed: int = 1
    seconds: float = 30.0        # pushing under faults
    clients: int = 3
    faults: tuple[str, ...] = FAULTS
    stall_seconds: tuple[float, float] = (1.0, 10.0)
    target: str = "any"          # "backup" or "primary": whom the faults hit
    pause: tuple[float, float] = (0.5, 2.0)
    ids: int = 30000             # push ids available (each shard's slice holds more values)
    min_in_sync: int = 1         # spec.parameterServers.minInSync
    kill_gap: float = 0.3        # "backup-then-primary": seconds between the two kills
    anytime: bool = False        # faults whatever the copies' state, not only once all are in sync
    optimizer: str = "sgd"       # or "adagrad": counts read through its steps, accumulators compared
    outage_seconds: tuple[float, float] = (5.0, 30.0)   # "store": how long the shard's view record is unreachable
    journal: bool = False        # spec.parameterServers.journal (with backups 0: one copy, its journal)

    @property
    def name(self) -> str:
        unkind = f"-insync{self.min_in_sync}-gap{self.kill_gap:g}" if "backup-then-primary" in self.faults else ""
        if self.anytime:
            unkind = f"-anytime-every{self.pause[0]:g}-{self.pause[1]:g}s-{'-'.join(self.faults)}-insync{self.min_in_sync}"
        optimizer = "" if self.optimizer == "sgd" else f"-{self.optimizer}"
        journal = "-journal" if self.journal else ""
        return f"{self.kind}{optimizer}-backups{self.backups}{journal}-seed{self.seed}{unkind}"


def job_doc(plan: Plan) -> dict[str, Any]:
    """The checker's job: two shards, no replicas of its own, SGD (or Adagrad) at learning rate 1."""
    model: dict[str, Any] = {"type": "mlp", "hiddenLayers": [1024], "activation": "relu"}
    data = {"source": "synthetic:features=64,classes=2,samples=2000,seed=1", "testFraction": 0.2}
    if plan.kind == "partitioned":  # two stages of about 66k parameters, one shard each
        model = {"type": "mlp", "hiddenLayers": [1024, 64], "activation": "relu", "partitions": 2}
    if plan.kind == "sparse":
        model = {"type": "mlp", "hiddenLayers": [1024], "activation": "relu",
                 # Plain rows (no wide part, no L2 decay, trained from the first push), so that a
                 # row's value counts the pushes applied to it.
                 "embeddings": {"dim": ROW_DIM, "hashBuckets": 0, "admitAfter": 1, "wide": False, "l2": 0.0,
                                "embedAfter": 1}}
        data = {"source": "synthetic-ctr:fields=16,ids=1000,samples=2000,seed=1", "testFraction": 0.2}
    return {"apiVersion": contract.JOB_API_VERSION, "kind": contract.KIND,
            "metadata": {"name": f"check-{plan.kind}"},
            "spec": {"model": model, "data": data,
                     "training": {"algorithm": "downpour", "optimizer": plan.optimizer, "learningRate": 1.0,
                                  "maxGradientNorm": 1e9, "batchSize": 32, "maxSteps": 10 ** 12,
                                  "evalEverySeconds": 5, "warmstartSteps": 0},
                     "parameterServers": {"shards": 2, "backups": plan.backups, "minInSync": plan.min_in_sync,
                                          "journal": plan.journal,
                                          "checkpoint": {"everySeconds": 1}},
                     "workers": {"replicas": 0},
                     "runPolicy": {"backoffLimit": 100}}}


class Cluster:
    """The job's local run, its copies' proxies, and what the checker reads of it."""

    def __init__(self, plan: Plan, output: str) -> None:
        self.plan, self.output = plan, output
        self.run = local.LocalRun(DistBeliefJob.validated(job_doc(plan)), output)
        self.config = self.run.job.config
        self.job = Job(self.config)
        self.net = netfault.Net().start()
        self.links: dict[tuple[str, str], netfault.Link] = {}  # (from pod, to pod) -> the proxy between
        for pod in self.run.shards:
            shard, rank = self.config.copy_of(contract.shard_index_from_pod_name(pod.name))
            routes = []
            for other in self.copies(shard):
                if other is pod:
                    routes.append(self.address(pod))
                else:
                    link = self.links[(pod.name, other.name)] = self.net.proxy(*self.copy_ports(other))
                    routes.append(link.address)
            pod.env[contract.ENV_COPY_ROUTES] = ",".join(routes)
        smallest = min(b - a for a, b in (self.job.layout.bounds(s) for s in range(self.config.spec.parameter_servers.shards)))
        if smallest < plan.ids:
            raise ValueError(f"a shard's slice holds {smallest} values, fewer than the {plan.ids} push ids")
        job_keys = keys.JobKeys.read(os.path.join(output, local.KEYS_FOLDER))
        self.client_options = job_keys.client_options(role=keys.REPLICA) if job_keys else None
        self.thread = threading.Thread(target=lambda: self.run.run(progress=False), daemon=True)

    @staticmethod
    def address(pod: LocalPod) -> str:
        return f"tcp://127.0.0.1:{pod.ports[contract.SHARD_PORT_NAME]}"

    @staticmethod
    def copy_ports(pod: LocalPod) -> list[int]:
        """The ports another copy reaches pod at: the shard's, and its bulk port (sessions)."""
        names = (contract.SHARD_PORT_NAME, contract.BULK_PORT_NAME)
        return [pod.ports[name] for name in names if name in pod.ports]

    def bulk_connections(self) -> int:
        """Connections the proxies took to copies' bulk ports: forwards sealed under sessions."""
        return sum(link.connections[port] for link in self.links.values() for port in link.target_ports[1:])

    def view_record(self, shard: int) -> str:
        return os.path.join(self.output, VIEWS_FOLDER, f"shard-{shard}.json")

    def copies(self, shard: int) -> list[LocalPod]:
        """The pods of a shard's copies, by rank."""
        servers = self.config.spec.parameter_servers
        return [self.run.shards[rank * servers.shards + shard] for rank in range(servers.copies)]

    def group(self, stop: threading.Event | None = None) -> ShardGroup:
        addresses = [[self.address(p) for p in self.copies(s)] for s in range(self.config.spec.parameter_servers.shards)]
        return ShardGroup(addresses, self.job.layout, timeouts=Timeouts(request=FAILOVER_ATTEMPT_SECONDS),
                          security=self.client_options, stop=stop)

    def in_sync(self, shard: int) -> dict[str, dict[str, float]] | None:
        """Each copy's figures when one is primary with every copy in its in-sync set."""
        seen = {pod.name: self.figures(pod) for pod in self.copies(shard) if pod.running}
        if len(seen) != self.config.spec.parameter_servers.copies or any(f is None for f in seen.values()):
            return None
        primaries = [f for f in seen.values() if f.get("role") == PRIMARY]
        if len(primaries) != 1 or primaries[0].get("copies") != self.config.spec.parameter_servers.copies:
            return None
        return seen  # type: ignore[return-value]

    def seen(self, shard: int) -> dict[str, dict[str, float]]:
        """Each copy's figures, empty for one that does not answer (dead, stopped, starting)."""
        return {pod.name: (self.figures(pod) if pod.running else None) or {} for pod in self.copies(shard)}

    def figures(self, pod: LocalPod) -> dict[str, float] | None:
        """A copy's figures; a shard without backups is its own primary, in sync with itself."""
        seen = figures(pod)
        if seen is None or self.config.spec.parameter_servers.copies > 1:
            return seen
        return {**seen, "role": PRIMARY, "copies": 1}

    def reported_lost(self) -> list[int]:
        """Each shard's count of the applied updates it lost, as its primary reports it."""
        return [max((f.get("lost", 0) for f in self.seen(s).values() if f.get("role") == PRIMARY), default=-1)
                for s in range(self.config.spec.parameter_servers.shards)]

    def wait_in_sync(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not all(self.in_sync(s) for s in range(self.config.spec.parameter_servers.shards)):
            if time.monotonic() > deadline or not self.thread.is_alive():
                return False
            time.sleep(0.2)
        return True

    def stop(self) -> None:
        self.net.heal()
        for pod in self.run.shards:
            pod.signal(signal.SIGCONT)
        self.run.interrupt()
        self.thread.join(timeout=120)
        self.net.stop()


def figures(pod: LocalPod) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(pod.metrics_url, timeout=1) as response:
            text = response.read().decode()
    except OSError:
        return None
    wanted = {"distbelief_copy_role": "role", "distbelief_copies_in_sync": "copies",
              contract.Metric.GLOBAL_STEP: "step", "distbelief_shard_updates_lost": "lost"}
    return {wanted[s.name]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name in wanted}


class Client(threading.Thread):
    """Pushes ids index, index + count, ... until told to stop; every push in the history."""

    def __init__(self, cluster: Cluster, index: int, count: int, history: list[Op], stopping: threading.Event,
                 give_up: threading.Event) -> None:
        super().__init__(name=f"check-client-{index}", daemon=True)
        self.cluster, self.index, self.count, self.history = cluster, index, count, history
        self.stopping, self.give_up = stopping, give_up
        self.failure: str | None = None
        # Each shard's step in this client's last acknowledgement: pushed as the step it
        # pulled, so that a shard that came back behind it counts what it lost (losses.py).
        self.pulled = [0] * cluster.config.spec.parameter_servers.shards

    def run(self) -> None:
        group = self.cluster.group(stop=self.give_up)
        layout, plan = group.layout, self.cluster.plan
        try:
            while not all(r.header.status == Status.OK for r in group.hello()):
                time.sleep(0.2)
            for i in range(self.index, plan.ids, self.count):
                if self.stopping.is_set():
                    break
                op = Op(id=i, start=time.monotonic())
                self.history.append(op)
                grad = np.zeros(layout.total, np.float32)
                for shard in range(layout.shards):
                    grad[layout.bounds(shard)[0] + i] = -1.0
                try:
                    if plan.kind == "partitioned":
                        self.commit(group, grad, op)
                    else:
                        self.push(group, grad, op)
                except errors.RuntimeFailure as exc:  # Stopped, or a shard unavailable for minutes
                    op.error = str(exc)
                    break
                finally:
                    op.end = time.monotonic()
        except errors.RuntimeFailure as exc:
            self.failure = str(exc)
        finally:
            group.close()

    def push(self, group: ShardGroup, grad: np.ndarray, op: Op) -> None:
        """A push (with sparse: the row of key op.id first), acknowledged once every shard answered."""
        if self.cluster.plan.kind == "sparse":
            RowClient(group, ROW_DIM).push(np.array([op.id], np.int64), -np.ones((1, ROW_DIM), np.float32))
        replies = Float32Dense(group).push(grad, steps=self.pulled, examples=1, loss=0.0)
        op.steps, op.acked = [r.step for r in replies], True
        self.pulled = [max(a, b) for a, b in zip(self.pulled, op.steps)]

    def commit(self, group: ShardGroup, grad: np.ndarray, op: Op) -> None:
        """A partitioned job's step, as its partition 0 makes one: the gradient HELD on every
        shard under a fresh token, then committed everywhere or nowhere (commit.py). Acknowledged
        when it was applied; refused (never to be applied anywhere) when it was dropped."""
        token, step_group = new_token(), self.index + 1
        replies = group.request(HOLD, meta=Held(step_group, token), array=grad, steps=[0] * group.layout.shards)
        statuses = {r.header.status for r in replies}
        held = next((s for s in (Status.DONE, Status.FULL, Status.STALE) if s in statuses), Status.OK)
        status = Commit(group).settle(step_group, token, held, examples=1, loss=0.0)
        op.kind, op.acked, op.refused = "held", status == Status.OK, status in (Status.STALE, Status.FULL)


class Reader(threading.Thread):
    """Pulls every shard's parameters again and again while the clients push, as a replica
    would: each pull a Read in the history, its counts read from the parameters it showed."""

    def __init__(self, cluster: Cluster, initial: np.ndarray, reads: list[copyverdict.Read],
                 stopping: threading.Event, give_up: threading.Event) -> None:
        super().__init__(name="check-reader", daemon=True)
        self.cluster, self.initial, self.reads = cluster, initial, reads
        self.stopping, self.give_up = stopping, give_up
        self.failure: str | None = None

    def run(self) -> None:
        group = self.cluster.group(stop=self.give_up)
        layout, plan = group.layout, self.cluster.plan
        starts = [layout.bounds(s)[0] for s in range(layout.shards)]
        values = np.empty(layout.total, np.float32)
        try:
            while not self.stopping.wait(READ_PAUSE_SECONDS):
                start = time.monotonic()
                steps = [r.step for r in Float32Dense(group).pull(values)]
                counts = np.stack([applications(values[a:a + plan.ids] - self.initial[a:a + plan.ids], plan.optimizer)
                                   for a in starts]).astype(np.int16)
                self.reads.append(copyverdict.Read(start, time.monotonic(), steps, counts))
        except errors.RuntimeFailure as exc:  # Stopped, or a shard unavailable for minutes
            self.failure = str(exc)
        finally:
            group.close()


class Nemesis(threading.Thread):
    """Seeded faults, one shard at a time, each once the shard's copies are all in sync."""

    def __init__(self, cluster: Cluster, plan: Plan, until: float) -> None:
        super().__init__(name="nemesis", daemon=True)
        self.cluster, self.plan, self.until = cluster, plan, until
        self.rng = random.Random(plan.seed)
        self.faults: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def run(self) -> None:
        while time.monotonic() < self.until:
            time.sleep(self.rng.uniform(*self.plan.pause))
            shard = self.rng.randrange(self.cluster.config.spec.parameter_servers.shards)
            seen = self.cluster.in_sync(shard)
            in_sync = seen is not None
            if seen is None:
                if not self.plan.anytime:
                    continue
                seen = self.cluster.seen(shard)
            kind = self.rng.choice(self.plan.faults)
            pods = self._targets(shard, seen, kind)
            if pods:
                self._inject(kind, shard, pods, seen)
                self.faults[-1]["in_sync"] = in_sync

    def _targets(self, shard: int, seen: dict[str, dict[str, float]], kind: str) -> list[LocalPod]:
        copies = self.cluster.copies(shard)
        target = "backup" if kind == "backup-then-primary" else self.plan.target
        wanted = {"any": copies, "primary": [p for p in copies if seen[p.name].get("role") == PRIMARY],
                  "backup": [p for p in copies if seen[p.name].get("role") != PRIMARY]}[target]
        many = 2 if self.plan.backups >= 2 and kind in ("kill", "stall") and self.rng.random() < 0.3 else 1
        return self.rng.sample(wanted, min(many, len(wanted)))

    def _inject(self, kind: str, shard: int, pods: list[LocalPod], seen: dict[str, dict[str, float]]) -> None:
        rng, names = self.rng, [p.name for p in pods]
        fault: dict[str, Any] = {"kind": kind, "shard": shard, "pods": names,
                                 "primary": [seen[n].get("role") == PRIMARY for n in names],
                                 "running": [p.running for p in pods],
                                 "at": round(time.monotonic() - self.started, 1)}
        links = [link for (a, b), link in self.cluster.links.items() if a in names or b in names]
        if kind == "kill":
            for pod in pods:
                pod.signal(signal.SIGKILL)
        elif kind == "backup-then-primary":  # unkind: the second kill ignores whether the first was caught up
            (backup,) = pods
            primary = next(p for p in self.cluster.copies(shard) if seen[p.name].get("role") == PRIMARY)
            fault.update(pods=[backup.name, primary.name], primary=[False, True], gap=self.plan.kill_gap)
            backup.signal(signal.SIGKILL)
            time.sleep(self.plan.kill_gap)
            primary.signal(signal.SIGKILL)
        elif kind == "stall":
            fault["seconds"] = round(rng.uniform(*self.plan.stall_seconds), 1)
            for pod in pods:
                pod.signal(signal.SIGSTOP)
            time.sleep(fault["seconds"])
            for pod in pods:
                pod.signal(signal.SIGCONT)
        elif kind == "delay":
            fault["delay"], fault["seconds"] = round(rng.uniform(0.05, 0.5), 2), round(rng.uniform(2, 8), 1)
            for link in links:
                link.up.delay = link.down.delay = fault["delay"]
            time.sleep(fault["seconds"])
            for link in links:
                link.heal()
        elif kind == "partition":
            (pod,) = pods[:1]
            other = rng.choice([p for p in self.cluster.copies(shard) if p is not pod])
            source, target = (pod, other) if rng.random() < 0.5 else (other, pod)
            fault.update(source=source.name, target=target.name, seconds=round(rng.uniform(1, 10), 1),
                         cut=rng.random() < 0.5)
            self.cluster.links[(source.name, target.name)].up.blocked = True    # what source sends target
            self.cluster.links[(target.name, source.name)].down.blocked = True  # ... on target's connections
            time.sleep(fault["seconds"])
            for link in (self.cluster.links[(source.name, target.name)], self.cluster.links[(target.name, source.name)]):
                if fault["cut"]:
                    link.reset()
                link.heal()
        elif kind == "cut":
            for link in links:
                link.reset()
        elif kind == "store":   # the view store, not a copy
            fault.update(pods=[], primary=[], running=[], seconds=round(rng.uniform(*self.plan.outage_seconds), 1),
                         began=time.monotonic())
            with storefault.outage(self.cluster.view_record(shard)):
                time.sleep(fault["seconds"])
            fault["ended"] = time.monotonic()
        self.faults.append(fault)


def run(plan: Plan, output: str | None = None, keep: str | None = None) -> dict[str, Any]:
    """One checked run; its faults, history figures and verdict. keep: a folder where the
    pods' logs of a run that failed are copied."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(plan, output or tmp)
        started = time.monotonic()
        cluster.thread.start()
        try:
            if not cluster.wait_in_sync(120):
                raise RuntimeError("the copies never came in sync")
            result = _checked(cluster, plan, started)
        except BaseException:
            cluster.stop()
            _keep_logs(cluster.output, keep, plan)
            raise
        cluster.stop()
        if not result["ok"]:
            _keep_logs(cluster.output, keep, plan)
        return result


def _keep_logs(output: str, keep: str | None, plan: Plan) -> None:
    if keep:
        shutil.copytree(os.path.join(output, "logs"), os.path.join(keep, plan.name), dirs_exist_ok=True)


def _checked(cluster: Cluster, plan: Plan, started: float) -> dict[str, Any]:
    group = cluster.group()
    layout, shards = group.layout, cluster.config.spec.parameter_servers.shards
    initial = np.empty(layout.total, np.float32)
    Float32Dense(group).pull(initial)
    keys_ = np.arange(plan.ids, dtype=np.int64)
    initial_rows = RowClient(group, ROW_DIM).pull(keys_)[0] if plan.kind == "sparse" else None
    history: list[Op] = []
    stopping, give_up = threading.Event(), threading.Event()
    clients = [Client(cluster, i, plan.clients, history, stopping, give_up) for i in range(plan.clients)]
    reads: list[copyverdict.Read] = []
    reader = Reader(cluster, initial, reads, stopping, give_up)
    for thread in [*clients, reader]:
        thread.start()
    nemesis = Nemesis(cluster, plan, until=time.monotonic() + plan.seconds)
    nemesis.start()
    nemesis.join()
    cluster.net.heal()
    settled = cluster.wait_in_sync(SETTLE_SECONDS)
    stopping.set()
    for thread in [*clients, reader]:
        thread.join(timeout=SETTLE_SECONDS)
    give_up.set()
    for thread in [*clients, reader]:
        thread.join(timeout=30)
    settled = cluster.wait_in_sync(SETTLE_SECONDS) and settled
    final = np.empty(layout.total, np.float32)
    steps = [r.step for r in Float32Dense(group).pull(final)]
    limit = plan.ids
    counts = np.stack([applications(final[a:a + limit] - initial[a:a + limit], plan.optimizer)
                       for a in (layout.bounds(s)[0] for s in range(shards))])
    result: dict[str, Any] = {
        "plan": {**dataclasses.asdict(plan), "name": plan.name}, "faults": nemesis.faults, "settled": settled,
        "clients_failed": [c.failure for c in [*clients, reader] if c.failure],
        "wall_seconds": round(time.monotonic() - started, 1),
        "verdict": copyverdict.verdict(history, counts, steps, limit=limit, atomic=plan.kind == "partitioned")}
    if initial_rows is not None:
        rows = RowClient(group, ROW_DIM).pull(keys_)[0]
        result["rows"] = copyverdict.rows_verdict(history, copyverdict.row_counts(initial_rows, rows))
    result["reads"] = copyverdict.reads_verdict(reads, history, counts)
    group.close()
    # A shard's count is a lower bound (shard/losses.py): a life that has applied as many
    # updates as it lost before a client comes back misses that client's, at most a push per
    # client and fault. A loss is silent beyond that.
    result["reported_lost"] = cluster.reported_lost()
    lost_by_shard, told = result["verdict"]["lost_by_shard"], result["reported_lost"]
    slack = [plan.clients * sum(f["shard"] == s for f in nemesis.faults) for s in range(shards)]
    result["lost_silently"] = [s for s in range(shards) if lost_by_shard[s] > told[s] + slack[s]]
    result["copies_differ"] = copies_differ(cluster)
    result["bulk_connections"] = cluster.bulk_connections()
    result["acked_in_outages"] = acked_in_outages(history, nemesis.faults)
    result["ok"] = bool(result["verdict"]["ok"] and result.get("rows", {"ok": True})["ok"] and settled
                        and result["reads"]["ok"] and not result["copies_differ"] and not result["acked_in_outages"])
    # Under an unkind schedule a loss the chosen rule allows is no failure, if it is told.
    v = result["verdict"]
    result["ok_as_told"] = bool(settled and not result["copies_differ"] and not result["lost_silently"]
                                and not v["duplicated"]["count"] and not v["phantom"]["count"]
                                and all(v["steps_match_applied"]) and not result["acked_in_outages"]
                                and not reads_unexplained(result["reads"], told))
    return result


def reads_unexplained(reads: dict[str, Any], told: list[int]) -> list[str]:
    """The read findings no reported loss explains: any on a shard that reported none, and
    torn ones anywhere (a reply's step and parameters always agree)."""
    return [f"{kind} on shard {shard}" for kind in copyverdict.READ_FINDINGS
            for shard, n in enumerate(reads[kind]["by_shard"]) if n and (kind == "torn" or told[shard] <= 0)]


OUTAGE_SLACK_SECONDS = 1.0  # a reply the primary sent just before its lease ran out, still on its way


def acked_in_outages(history: list[Op], faults: list[dict[str, Any]]) -> list[int]:
    """The pushes acknowledged while a shard's view record had been unreachable for more than
    a lease: there must be none, as a primary acknowledges only while its lease holds and
    cannot renew it then, and a push is acknowledged only once every shard answered it."""
    windows = [(f["began"] + LEASE_SECONDS + OUTAGE_SLACK_SECONDS, f["ended"]) for f in faults if f["kind"] == "store"]
    return sorted(op.id for op in history if op.acked and op.end is not None
                  and any(start < op.end < end for start, end in windows))


ADAGRAD_MOVES = np.concatenate([[0.0], np.cumsum(1 / np.sqrt(np.arange(1, 65)))])  # after k applications


def applications(moved: np.ndarray, optimizer: str) -> np.ndarray:
    """How many times each push was applied, from how far its coordinate moved. Every
    gradient value is -1 at learning rate 1: SGD moves it by 1 each time; Adagrad (its
    accumulator from 0) by 1/sqrt(k) at the k-th time, so k is read from a table (up to 64)."""
    if optimizer == "sgd":
        return np.rint(moved).astype(np.int64)
    midpoints = (ADAGRAD_MOVES[:-1] + ADAGRAD_MOVES[1:]) / 2
    return np.searchsorted(midpoints, moved).astype(np.int64)


def copies_differ(cluster: Cluster) -> list[str]:
    """The shards whose copies, stopped in sync, left checkpoints of one step with other
    values: parameters, or optimizer state (Adagrad's accumulators)."""
    cluster.run.interrupt()
    cluster.thread.join(timeout=120)
    differ = []
    for shard in range(cluster.config.spec.parameter_servers.shards):
        newest = {}
        for pod in cluster.copies(shard):
            found = checkpoint.list_checkpoints(volume_dir(cluster.output, pod.name, contract.CHECKPOINT_VOLUME))
            if found:
                newest[pod.name] = checkpoint.load(found[0])
        steps = {c.step for c in newest.values()}
        if len(steps) != 1:
            differ.append(f"shard {shard}: final steps {sorted(steps)}")
            continue
        first, *others = map(training_state, newest.values())
        for name in first:
            if any(not np.array_equal(first[name], other.get(name)) for other in others):
                differ.append(f"shard {shard}: copies at step {next(iter(steps))} hold different {name}")
    return differ


def training_state(ckpt: checkpoint.Checkpoint) -> dict[str, np.ndarray]:
    """What every copy must hold alike: the dense parameters and optimizer state, and the
    rows' values and accumulators by key; not when each copy last touched a row (kept
    relative to its own checkpoint's time)."""
    arrays = ckpt.arrays
    state = {name: arrays[name] for name in ("params", "adagrad_accumulator") if name in arrays}
    if "sparse.keys" in arrays:  # saved flat, a row's key in 3 parts and its values after one another
        rows = arrays["sparse.accumulators"].size
        order = np.argsort(keys_from_parts(arrays["sparse.keys"]), kind="stable")
        state.update({name: arrays[name].reshape(rows, -1)[order]
                      for name in ("sparse.keys", "sparse.values", "sparse.accumulators")})
    return state


def plans(runs: int, seconds: float, seed: int) -> list[Plan]:
    """Dense, sparse and partitioned, backups 1 and 2, seeded; and issue 31's stalls (a copy of three
    frozen for 7 s, again and again: backups on a dense job, primaries on a sparse one)."""
    stalls = dict(backups=2, seed=seed, seconds=max(seconds, 50.0), faults=("stall",), stall_seconds=(7.0, 7.0),
                  pause=(1.0, 1.0))
    chosen = [Plan(kind="dense", target="backup", **stalls), Plan(kind="sparse", target="primary", **stalls)]
    kinds = [(kind, backups) for backups in (1, 2) for kind in ("dense", "sparse", "partitioned")]
    for run_index in range(runs):
        kind, backups = kinds[run_index % len(kinds)]
        chosen.append(Plan(kind=kind, backups=backups, seed=seed + run_index, seconds=seconds))
    return chosen


def unkind_plans(seconds: float, seed: int) -> list[Plan]:
    """A backup and then its primary killed, minInSync 1 and 2, the second kill before and
    after the primary could have dropped the first (about 3 s); and faults 2-9 s apart at
    any time, whatever the copies' state, on Adagrad jobs: SIGKILLs with backups 1 (minInSync
    1 and 2, dense and sparse), and with backups 2 SIGKILLs and stalls, then SIGKILLs, partitions and cuts, then
    SIGKILLs and 30 s view-store outages; SIGKILLs 0.5-2 s apart with backups 1 (minInSync
    1 and 2); and SIGKILLs 2-9 and 0.5-2 s apart with backups 0 and the journal (a storm of a
    sparse job too)."""
    gaps = [Plan(kind="dense", backups=1, seed=seed, seconds=seconds, faults=("backup-then-primary",),
                 pause=(4.0, 8.0), min_in_sync=needed, kill_gap=gap)
            for gap in (0.3, 5.0) for needed in (1, 2)]
    # At most 40 s: the clients use up the 30,000 push ids in about 45 s of such a schedule.
    anytime = dict(kind="dense", optimizer="adagrad", seed=seed, seconds=min(seconds, 40.0), pause=(2.0, 9.0),
                   anytime=True)
    return [*gaps, *(Plan(backups=1, faults=("kill",), min_in_sync=needed, **anytime) for needed in (1, 2)),  # type: ignore[arg-type]
            *(Plan(backups=1, faults=("kill",), min_in_sync=needed, **{**anytime, "kind": "sparse"})  # type: ignore[arg-type]
              for needed in (1, 2)),
            Plan(backups=2, faults=("kill", "stall"), **anytime),  # type: ignore[arg-type]
            Plan(backups=2, faults=("kill", "partition", "cut"), **anytime),  # type: ignore[arg-type]
            # the view store unreachable for 30 s at a time, and kills, whatever the copies' state
            Plan(backups=2, faults=("kill", "store"), outage_seconds=(30.0, 30.0), **anytime),  # type: ignore[arg-type]
            # a storm: most kills land while a copy is still restarting or catching up
            *(Plan(backups=1, faults=("kill",), min_in_sync=needed, **{**anytime, "pause": (0.5, 2.0)})  # type: ignore[arg-type]
              for needed in (1, 2)),
            # no copies, the journal: kills 2-9 s apart, and storms, of dense and sparse jobs
            *(Plan(backups=0, journal=True, faults=("kill",), **{**anytime, "pause": pause, "kind": kind})  # type: ignore[arg-type]
              for pause, kind in (((2.0, 9.0), "dense"), ((0.5, 2.0), "dense"), ((0.5, 2.0), "sparse")))]


def faults_by_kind(faults: list[dict[str, Any]]) -> dict[str, int]:
    """The copies each kind of fault hit (a view-store outage, which hits none, counts once)."""
    counts: dict[str, int] = {}
    for fault in faults:
        counts[fault["kind"]] = counts.get(fault["kind"], 0) + (len(fault["pods"]) or 1)
    return counts


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    faults = faults_by_kind([fault for result in results for fault in result["faults"]])
    verdicts = [r["verdict"] for r in results]
    return {"runs": len(results), "ok": sum(r["ok"] for r in results), "faults": faults,
            "acknowledged": sum(v["acknowledged"] for v in verdicts),
            "indeterminate": sum(v["indeterminate"] for v in verdicts),
            "lost": sum(v["lost"]["count"] for v in verdicts) + sum(r.get("rows", {}).get("lost", {}).get("count", 0)
                                                                    for r in results),
            "duplicated": sum(v["duplicated"]["count"] for v in verdicts)
            + sum(r.get("rows", {}).get("duplicated", {}).get("count", 0) for r in results),
            "went_back": sum(len(v["went_back"]) for v in verdicts),
            "reads": sum(r["reads"]["reads"] for r in results),
            **{f"reads_{kind}": sum(r["reads"][kind]["count"] for r in results) for kind in copyverdict.READ_FINDINGS},
            "half_applied": sum(v["half_applied"]["count"] for v in verdicts),
            "runs_that_lost_silently": sum(bool(r["lost_silently"]) for r in results),
            "faults_out_of_sync": sum(not f.get("in_sync", True) for r in results for f in r["faults"])}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=8, help="randomized runs, besides the two stall runs")
    p.add_argument("--seconds", type=float, default=30.0, help="pushing under faults, per run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--strict", action="store_true", help="exit 1 when a run's verdict is not ok")
    p.add_argument("--unkind", action="store_true", help="the backup-then-primary schedules instead (unkind_plans)")
    p.add_argument("--keep", default=os.path.join(tempfile.gettempdir(), "copycheck-logs"),
                   help="where the pods' logs of a run that failed or could not be checked go")
    args = p.parse_args()
    results, crashed = [], []
    for plan in unkind_plans(args.seconds, args.seed) if args.unkind else plans(args.runs, args.seconds, args.seed):
        result = None
        for attempt in (1, 2):  # a run whose job cannot start (a pod's port taken meanwhile) is tried again
            try:
                result = run(plan, keep=args.keep)
                break
            except Exception as exc:  # a run that could not be checked is reported, the others go on
                print(f"{plan.name} could not be checked (attempt {attempt}): {exc!r} (logs in {args.keep})",
                      flush=True)
                if attempt == 2:
                    crashed.append({"run": plan.name, "error": repr(exc)})
        if result is None:
            continue
        results.append(result)
        v = result["verdict"]
        print(f"{plan.name} faults={len(result['faults'])} acknowledged={v['acknowledged']} lost={v['lost']['count']} "
              f"(by shard {v['lost_by_shard']}, reported {result['reported_lost']}) "
              f"duplicated={v['duplicated']['count']} reads={result['reads']['reads']} "
              f"stale={result['reads']['stale']['count']} dirty={result['reads']['dirty']['count']} ok={result['ok']}",
              flush=True)
    report = {"copies_check": {"summary": {**summary(results), "not_checked": crashed},
                               "runs": [brief(r) for r in results]}}
    print(json.dumps(report["copies_check"]["summary"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if (all(r["ok"] for r in results) and not crashed) or not args.strict else 1


def brief(result: dict[str, Any]) -> dict[str, Any]:
    """One run in a line or two: its plan, its faults by kind, its verdict's counts."""
    v = result["verdict"]
    return {"run": result["plan"]["name"], "faults": faults_by_kind(result["faults"]), "acknowledged": v["acknowledged"],
            "indeterminate": v["indeterminate"], "lost": v["lost"]["count"], "duplicated": v["duplicated"]["count"],
            "rows_lost": result.get("rows", {}).get("lost", {}).get("count"), "went_back": len(v["went_back"]),
            "half_applied": v["half_applied"]["count"], "refused": v["refused"],
            "lost_by_shard": v["lost_by_shard"], "reported_lost": result["reported_lost"],
            "lost_silently": result["lost_silently"], "ok_as_told": result["ok_as_told"],
            "reads": result["reads"]["reads"],
            **{f"reads_{kind}": result["reads"][kind]["count"] for kind in copyverdict.READ_FINDINGS},
            "steps": v["steps"], "ok": result["ok"], "wall_seconds": result["wall_seconds"],
            "bulk_connections": result["bulk_connections"]}


if __name__ == "__main__":
    raise SystemExit(main())
