"""Sandblaster L-BFGS's hooks (interface.py): its shards' vectors, the coordinator beside
the chief, and its replicas' loop (the package's __init__ says how they work together)."""

from __future__ import annotations

from distbelief.runtime.algorithms.interface import Algorithm, ChiefContext, ReplicaContext, ReplicaLoop, initial_slice
from distbelief.runtime.algorithms.sandblaster.coordinator import Coordinator, CoordinatorSettings
from distbelief.runtime.algorithms.sandblaster.lbfgs import LbfgsSettings
from distbelief.runtime.algorithms.sandblaster.replica import CoordinatorLink, Replica
from distbelief.runtime.algorithms.sandblaster.vectors import ShardVectors
from distbelief.runtime.model.job import Job
from distbelief.runtime.observe.metrics import CoordinatorMetrics
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.shard.core import Shard


def _attach(shard: Shard, job: Job) -> None:
    training = job.spec.training
    dense = DenseSlice(shard, initial_slice(shard, job), optimizer=training.optimizer,
                       learning_rate=training.learning_rate, pushes=False)
    shard.attach(dense)
    shard.attach(ShardVectors(shard, dense, training.sandblaster.history_size))


def _coordinator(ctx: ChiefContext) -> Coordinator:
    training = ctx.job.spec.training
    options = training.sandblaster
    settings = CoordinatorSettings(
        bind=ctx.coordinator_bind, examples=len(ctx.job.dataset.x_train), unit_size=options.work_unit_size,
        backups=options.backup_tasks, max_iterations=training.max_steps,
        lbfgs=LbfgsSettings(history=options.history_size, gradient_tolerance=options.gradient_tolerance),
        security=ctx.server_security)
    coordinator = Coordinator(settings, ctx.group(), CoordinatorMetrics(ctx.registry))
    coordinator.on_failure = ctx.shard.stop
    coordinator.on_evaluated = ctx.shard.count_examples  # the job's examples/s, as Downpour's pushes feed it
    coordinator.start()
    return coordinator


def _replica(ctx: ReplicaContext) -> ReplicaLoop:
    link = CoordinatorLink(ctx.job.config.coordinator_address(), worker_id=ctx.group.worker_id,
                           layout=ctx.job.layout.hash, security=ctx.client_security, stop=ctx.stop)
    return Replica(ctx.group, link, ctx.job.model, ctx.job.dataset, ctx.metrics, stop=ctx.stop)


SANDBLASTER = Algorithm(name="sandblaster", attach=_attach, beside_chief=_coordinator,
                        replica=_replica,
                        optimizer_state=lambda shard: lambda: shard.plugin(ShardVectors).coordinator_state)
