"""The training algorithms, by the name spec.training.algorithm gives them.

An algorithm is three hooks on the roles' common core:

    attach(shard, job)           the plugins a shard serves (its ops and checkpointed state)
    beside_chief(ctx)            what runs beside shard 0 with the chief (Sandblaster's
                                 coordinator), or None; returns something with stop()/failure
    replica(ctx)                 the replica's loop: an object with run() -> why it ended,
                                 joined (an Event) and steps
    held_out(job, group)         what the chief scores, when it is not the model on the data's
                                 x (Downpour with embeddings: the MLP on the shards' rows)

Adding an algorithm is a module with these three functions and one line in ALGORITHMS;
the shard core, the replica runner and the roles do not change.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Protocol

import numpy as np
import prometheus_client as prom

from distbelief.runtime import keys
from distbelief.runtime.client.group import ShardGroup
from distbelief.runtime.model import models
from distbelief.runtime.model.embedding import EmbeddingModel
from distbelief.runtime.observe.metrics import CoordinatorMetrics, WorkerMetrics
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.params.rows.sparse import SparseRows
from distbelief.runtime.pipeline.rendezvous import Rendezvous, RendezvousLink
from distbelief.runtime.pipeline.replica import FirstPartition, LaterPartition, PodLinks, PodSettings
from distbelief.runtime.pipeline.staged import HeldGradients
from distbelief.runtime.sandblaster.coordinator import Coordinator, CoordinatorSettings
from distbelief.runtime.sandblaster.lbfgs import LbfgsSettings
from distbelief.runtime.sandblaster.replica import CoordinatorLink, Replica
from distbelief.runtime.sandblaster.vectors import ShardVectors
from distbelief.runtime.shard.core import Shard
from distbelief.runtime.sparse_worker import HeldOut, SparseWorker, held_out_inputs
from distbelief.runtime.transport import zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.worker import Worker, WorkerSettings


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

    job: Any                      # roles.Job
    shard: Shard
    registry: prom.CollectorRegistry
    group: Callable[..., ShardGroup]   # (shards=None: all, stop=None) -> a fresh client of those shards
    server_security: keys.ServerSecurity | None
    coordinator_bind: str


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
    job: Any                      # roles.Job
    group: ShardGroup             # every shard; a partition k > 0: the shards of its stage
    metrics: WorkerMetrics
    client_security: dict | None
    stop: threading.Event
    stage: StageAccess = StageAccess()


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str
    attach: Callable[[Shard, Any], None]
    beside_chief: Callable[[ChiefContext], Helper | None]
    replica: Callable[[ReplicaContext], ReplicaLoop]
    optimiser_state: Callable[[Shard], Callable[[], dict | None]] = lambda shard: (lambda: None)
    held_out: Callable[[Any, ShardGroup], HeldOut | None] = lambda job, group: None


def _initial(shard: Shard, job: Any) -> np.ndarray:
    """The shard's slice of the model's initial parameters (never the whole vector)."""
    return models.initial_slice(job.model, int(job.spec["training"]["seed"]), *job.layout.bounds(shard.index))


# -- Downpour SGD ------------------------------------------------------------------------


def _downpour_attach(shard: Shard, job: Any) -> None:
    training = job.spec["training"]
    dense = DenseSlice(shard, _initial(shard, job), optimizer=str(training["optimizer"]),
                       learning_rate=float(training["learningRate"]),
                       max_gradient_norm=float(training["maxGradientNorm"]),
                       max_staleness=training.get("maxStaleness"), wire_format=_wire_format(job))
    shard.attach(dense)
    if job.plan is not None:
        shard.attach(HeldGradients(dense))
    if isinstance(job.model, EmbeddingModel):
        options = job.spec["model"]["embeddings"]
        expire = options.get("expireAfterSeconds")
        shard.attach(SparseRows(shard, dim=job.model.dim, learning_rate=float(training["learningRate"]),
                                seed=int(training["seed"]), admit_after=int(options.get("admitAfter", 1)),
                                expire_after=float(expire) if expire else None,
                                max_gradient_norm=float(training["maxGradientNorm"])))


def _downpour_replica(ctx: ReplicaContext) -> ReplicaLoop:
    if ctx.job.plan is not None:
        return _partition_pod(ctx)
    training = ctx.job.spec["training"]
    settings = WorkerSettings(batch_size=int(training["batchSize"]), fetch_every=int(training["fetchEvery"]),
                              push_every=int(training["pushEvery"]))
    if isinstance(ctx.job.model, EmbeddingModel):
        return SparseWorker(settings, ctx.group, ctx.job.model, ctx.job.dataset, ctx.metrics, stop=ctx.stop)
    return Worker(settings, ctx.group, ctx.job.model, ctx.job.dataset, ctx.metrics, stop=ctx.stop,
                  wire_format=_wire_format(ctx.job))


def _wire_format(job: Any) -> str:
    """spec.parameterServers.wireFormat (the operator refuses it where only float32 works)."""
    return str(job.spec["parameterServers"].get("wireFormat", "float32"))


def _downpour_held_out(job: Any, group: ShardGroup) -> HeldOut | None:
    if not isinstance(job.model, EmbeddingModel):
        return None
    limit, dataset = int(job.spec["data"]["maxEvalExamples"]), job.dataset
    return held_out_inputs(job.model, group, dataset.x_test[:limit], dataset.ids_test[:limit])


def _downpour_beside_chief(ctx: ChiefContext) -> Rendezvous | None:
    if ctx.job.plan is None:
        return None
    return Rendezvous(ctx.coordinator_bind, len(ctx.job.plan.stages), ctx.job.layout.hash,
                      security=ctx.server_security, finished=lambda: ctx.shard.finished is not None).start()


def _partition_pod(ctx: ReplicaContext) -> ReplicaLoop:
    """A pod of a partitioned replica (spec.model.partitions > 1): its stage of the model."""
    job, access, group = ctx.job, ctx.stage, ctx.group
    training = job.spec["training"]
    stage = job.plan.stages[access.partition]
    settings = PodSettings(batch_size=int(training["batchSize"]), fetch_every=int(training["fetchEvery"]),
                           push_every=int(training["pushEvery"]), classes=job.dataset.n_classes)
    me = access.address or f"partition-0/{group.worker_id:08x}"  # partition 0 serves nothing: a name will do
    rendezvous = RendezvousLink(job.config.coordinator_address(), partition=access.partition, me=me,
                                worker_id=group.worker_id, layout=job.layout.hash, security=ctx.client_security,
                                stop=ctx.stop)
    tp = zmq_transport.default()
    if access.partition == 0:
        own = ShardGroup(job.config.shard_addresses(), job.layout, worker_id=group.worker_id, stop=ctx.stop,
                         security=ctx.client_security, shards=job.stage_shards(0))
        links = PodLinks(own, rendezvous, tp, access.client, everyone=group)
        return FirstPartition(settings, stage, links, ctx.metrics, job.dataset, stop=ctx.stop)
    values = settings.batch_size * (stage.input_width + 1)
    server = tp.server(access.bind, who=f"stage {access.partition}", max_frame=protocol.max_frame_bytes(values),
                       max_frames=3, security=access.server)
    return LaterPartition(settings, stage, PodLinks(group, rendezvous, tp, access.client), ctx.metrics, server,
                          stop=ctx.stop)


DOWNPOUR = Algorithm(name="downpour", attach=_downpour_attach, beside_chief=_downpour_beside_chief,
                     replica=_downpour_replica, held_out=_downpour_held_out)


# -- Sandblaster L-BFGS --------------------------------------------------------------------


def _sandblaster_attach(shard: Shard, job: Any) -> None:
    training = job.spec["training"]
    dense = DenseSlice(shard, _initial(shard, job), optimizer=str(training["optimizer"]),
                       learning_rate=float(training["learningRate"]), pushes=False)
    shard.attach(dense)
    shard.attach(ShardVectors(shard, dense, int(training["sandblaster"]["historySize"])))


def _sandblaster_coordinator(ctx: ChiefContext) -> Coordinator:
    training = ctx.job.spec["training"]
    options = training["sandblaster"]
    settings = CoordinatorSettings(
        bind=ctx.coordinator_bind, examples=len(ctx.job.dataset.x_train), unit_size=int(options["workUnitSize"]),
        backups=bool(options["backupTasks"]), max_iterations=int(training["maxSteps"]),
        lbfgs=LbfgsSettings(history=int(options["historySize"]),
                            gradient_tolerance=float(options["gradientTolerance"])),
        security=ctx.server_security)
    coordinator = Coordinator(settings, ctx.group(), CoordinatorMetrics(ctx.registry))
    coordinator.on_failure = ctx.shard.stop
    coordinator.on_evaluated = ctx.shard.count_examples  # the job's examples/s, as Downpour's pushes feed it
    coordinator.start()
    return coordinator


def _sandblaster_replica(ctx: ReplicaContext) -> ReplicaLoop:
    link = CoordinatorLink(ctx.job.config.coordinator_address(), worker_id=ctx.group.worker_id,
                           layout=ctx.job.layout.hash, security=ctx.client_security, stop=ctx.stop)
    return Replica(ctx.group, link, ctx.job.model, ctx.job.dataset, ctx.metrics, stop=ctx.stop)


SANDBLASTER = Algorithm(name="sandblaster", attach=_sandblaster_attach, beside_chief=_sandblaster_coordinator,
                        replica=_sandblaster_replica,
                        optimiser_state=lambda shard: lambda: shard.plugin(ShardVectors).coordinator_state)

ALGORITHMS = {a.name: a for a in (DOWNPOUR, SANDBLASTER)}


def of(job: Any) -> Algorithm:
    return ALGORITHMS[job.spec["training"].get("algorithm", "downpour")]
