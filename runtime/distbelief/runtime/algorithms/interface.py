"""What an algorithm is to the roles: a name and a few hooks, and what each hook is given.

    attach(shard, job)           the plugins a shard serves (its ops and checkpointed state)
                                 and the hooks it calls on each update
    beside_chief(ctx)            what runs beside shard 0 with the chief (Sandblaster's
                                 coordinator, a partitioned job's rendezvous), or None;
                                 returns something with stop()/failure
    replica(ctx)                 the replica's loop: an object with run() -> why it ended,
                                 joined (an Event) and steps
    optimizer_state(shard)       what the chief reads of shard 0's optimizer (Sandblaster's
                                 committed state: its convergence and objective)
    held_out(job, group)         what the chief scores, when it is not the model on the data's
                                 x (Downpour with embeddings: the MLP on the shards' rows)

An algorithm lives in a package of its own (downpour/, sandblaster/, pipeline/) and is
listed in registry.py; the shard core, the replica runner and the roles do not change.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Protocol

import numpy as np
import prometheus_client as prom

from distbelief.runtime import keys
from distbelief.runtime.algorithms.chief import HeldOut
from distbelief.runtime.client.group import ShardGroup
from distbelief.runtime.model import models
from distbelief.runtime.model.job import Job
from distbelief.runtime.observe.metrics import WorkerMetrics
from distbelief.runtime.shard.core import Shard


class ReplicaLoop(Protocol):
    joined: threading.Event
    steps: int

    def run(self) -> str: ...


class Helper(Protocol):
    failure: BaseException | None

    def stop(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class ChiefContext:
    """What runs beside shard 0 gets: the job, the shard, a fresh client of every shard."""

    job: Job
    shard: Shard
    registry: prom.CollectorRegistry
    group: Callable[..., ShardGroup]   # (shards=None: all, stop=None) -> a fresh client of those shards
    server_security: keys.ServerSecurity | None
    coordinator_bind: str
    output_dir: str | None = None     # the chief's folder (the checkpoints'), for what it records


@dataclasses.dataclass(frozen=True)
class StageAccess:
    """A partition pod's stage: which partition, where it serves and is reached, its keys."""

    partition: int = 0
    bind: str | None = None                       # where a partition k > 0 serves FORWARDs
    address: str | None = None                    # where its group's other pods reach it
    server: keys.ServerSecurity | None = None
    client: dict | None = None                    # a DEALER to the next stage


@dataclasses.dataclass(frozen=True)
class ReplicaContext:
    job: Job
    group: ShardGroup             # every shard; a partition k > 0: the shards of its stage
    metrics: WorkerMetrics
    client_security: dict | None
    stop: threading.Event
    stage: StageAccess = StageAccess()


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str
    attach: Callable[[Shard, Job], None]
    beside_chief: Callable[[ChiefContext], Helper | None]
    replica: Callable[[ReplicaContext], ReplicaLoop]
    optimizer_state: Callable[[Shard], Callable[[], dict | None]] = lambda shard: (lambda: None)
    held_out: Callable[[Job, ShardGroup], HeldOut | None] = lambda job, group: None


def initial_slice(shard: Shard, job: Job) -> np.ndarray:
    """The shard's slice of the model's initial parameters (never the whole vector)."""
    return models.initial_slice(job.model, job.spec.training.seed, *job.layout.bounds(shard.index))
