"""The training algorithms, by the name spec.training.algorithm gives them.

Each is an interface.Algorithm: a name and its hooks, from its package (downpour/,
sandblaster/). A Downpour job whose model is partitioned (spec.model.partitions > 1) uses
the pipeline's hooks (pipeline/) for its shards' held gradients, the rendezvous beside
the chief and its pods. Adding an algorithm is a package with its hooks and one line in
ALGORITHMS; the shard core, the replica runner and the roles do not change.
"""

from __future__ import annotations

from distbelief.runtime.algorithms.downpour import algorithm as downpour
from distbelief.runtime.algorithms.interface import Algorithm, ChiefContext, Helper, ReplicaContext, ReplicaLoop
from distbelief.runtime.algorithms.pipeline import algorithm as pipeline
from distbelief.runtime.algorithms.sandblaster.algorithm import SANDBLASTER
from distbelief.runtime.model.job import Job
from distbelief.runtime.shard.core import Shard


def _downpour_attach(shard: Shard, job: Job) -> None:
    dense = downpour.attach(shard, job)
    if job.plan is not None:
        pipeline.attach(shard, dense)


def _downpour_beside_chief(ctx: ChiefContext) -> Helper | None:
    return pipeline.beside_chief(ctx) if ctx.job.plan is not None else None


def _downpour_replica(ctx: ReplicaContext) -> ReplicaLoop:
    return pipeline.replica(ctx) if ctx.job.plan is not None else downpour.replica(ctx)


DOWNPOUR = Algorithm(name="downpour", attach=_downpour_attach, beside_chief=_downpour_beside_chief,
                     replica=_downpour_replica, held_out=downpour.held_out)

ALGORITHMS = {a.name: a for a in (DOWNPOUR, SANDBLASTER)}


def of(job: Job) -> Algorithm:
    """The algorithm of spec.training.algorithm."""
    return ALGORITHMS[job.spec.training.algorithm]
