"""Downpour SGD's hooks (interface.py): what its shards serve, and its replicas' loop.

A shard holds its dense slice (pushes applied as they come, with the job's optimizer and
maxStaleness), Downpour's update hook (updates.py: warm-start admission, staleness, the
replicas' loss) and, with embeddings, the sparse rows. A replica is a Worker, or a
SparseWorker when the model has embeddings. A partitioned model's shards and pods are the
pipeline's (pipeline/algorithm.py); registry.py puts the two together.
"""

from __future__ import annotations

from typing import Any

from distbelief.runtime.algorithms.chief import HeldOut
from distbelief.runtime.algorithms.downpour.sparse_worker import SparseWorker, held_out_inputs
from distbelief.runtime.algorithms.downpour.updates import DownpourUpdates
from distbelief.runtime.algorithms.downpour.worker import Worker, WorkerSettings
from distbelief.runtime.algorithms.interface import ReplicaContext, ReplicaLoop, initial_slice
from distbelief.runtime.client.group import ShardGroup
from distbelief.runtime.model import embedding
from distbelief.runtime.model.embedding import EmbeddingModel
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.params.rows.sparse import SparseRows, row_budget
from distbelief.runtime.shard.core import Shard


OPTIMIZER_ARRAYS = 4  # a dense slice's arrays: parameters, optimizer state, a clipped copy, a pulled copy


def attach(shard: Shard, job: Any) -> DenseSlice:
    """The shard's plugins and update hook; returns its dense slice."""
    training = job.spec["training"]
    dense = DenseSlice(shard, initial_slice(shard, job), optimizer=str(training["optimizer"]),
                       learning_rate=float(training["learningRate"]),
                       max_gradient_norm=float(training["maxGradientNorm"]),
                       max_staleness=training.get("maxStaleness"), wire_format=wire_format(job))
    shard.attach(dense)
    shard.watch_updates(DownpourUpdates(shard, warmstart_steps=int(training["warmstartSteps"])))
    if isinstance(job.model, EmbeddingModel):
        shard.attach(sparse_rows(shard, job, dense.params.nbytes))
    return dense


def sparse_rows(shard: Shard, job: Any, dense_bytes: int) -> SparseRows:
    """The shard's embedding rows as spec.model.embeddings and spec.training ask."""
    options, training = job.spec["model"]["embeddings"], job.spec["training"]
    expire = options.get("expireAfterSeconds")
    rows = SparseRows(shard, dim=job.model.width, learning_rate=float(training["learningRate"]),
                      seed=int(training["seed"]), admit_after=int(options.get("admitAfter", 1)),
                      expire_after=float(expire) if expire else None,
                      max_gradient_norm=float(training["maxGradientNorm"]), wide=job.model.wide,
                      l2=float(options.get("l2", embedding.L2)), wide_l2=float(options.get("wideL2", embedding.WIDE_L2)),
                      embed_after=int(options.get("embedAfter", embedding.EMBED_AFTER)),
                      push_examples=int(training["batchSize"]) * int(training.get("pushEvery", 1)),
                      fields=job.dataset.fields)
    budget = options.get("maxRowsPerShard")
    if budget is None:
        limit = ((job.spec["parameterServers"].get("resources") or {}).get("limits") or {}).get("memory")
        budget = row_budget(limit, rows.table.row_bytes(), job.dataset.nbytes + OPTIMIZER_ARRAYS * dense_bytes)
    rows.table.max_rows = None if budget is None else int(budget)
    shard.metrics.row_budget.set(budget or 0)
    return rows


def replica(ctx: ReplicaContext) -> ReplicaLoop:
    """An unpartitioned replica's loop."""
    training = ctx.job.spec["training"]
    settings = WorkerSettings(batch_size=int(training["batchSize"]), fetch_every=int(training["fetchEvery"]),
                              push_every=int(training["pushEvery"]))
    if isinstance(ctx.job.model, EmbeddingModel):
        return SparseWorker(settings, ctx.group, ctx.job.model, ctx.job.dataset, ctx.metrics, stop=ctx.stop)
    return Worker(settings, ctx.group, ctx.job.model, ctx.job.dataset, ctx.metrics, stop=ctx.stop,
                  wire_format=wire_format(ctx.job))


def wire_format(job: Any) -> str:
    """spec.parameterServers.wireFormat (the operator refuses it where only float32 works)."""
    return str(job.spec["parameterServers"].get("wireFormat", "float32"))


def held_out(job: Any, group: ShardGroup) -> HeldOut | None:
    if not isinstance(job.model, EmbeddingModel):
        return None
    limit, dataset = int(job.spec["data"]["maxEvalExamples"]), job.dataset
    return held_out_inputs(job.model, group, dataset.x_test[:limit], dataset.ids_test[:limit])
