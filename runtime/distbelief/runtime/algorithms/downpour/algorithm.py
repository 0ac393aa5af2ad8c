"""Downpour SGD's hooks (interface.py): what its shards serve, and its replicas' loop.

A shard holds its dense slice (pushes applied as they come, with the job's optimizer and
maxStaleness), Downpour's update hook (updates.py: warm-start admission, staleness, the
replicas' loss) and, with embeddings, the sparse rows. A replica is a Worker, or a
SparseWorker when the model has embeddings. A partitioned model's shards and pods are the
pipeline's (pipeline/algorithm.py); registry.py puts the two together.
"""

from __future__ import annotations

from distbelief.runtime.algorithms.chief import HeldOut
from distbelief.runtime.algorithms.downpour.sparse_worker import SparseWorker, held_out_inputs
from distbelief.runtime.algorithms.downpour.updates import DownpourUpdates
from distbelief.runtime.algorithms.downpour.worker import Worker
from distbelief.runtime.algorithms.feed import hooks as feed
from distbelief.runtime.algorithms.interface import ReplicaContext, ReplicaLoop, initial_slice
from distbelief.runtime.client.group import ShardGroup
from distbelief.runtime.model.embedding import EmbeddingModel
from distbelief.runtime.model.job import Job
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.params.rows.sparse import SparseRows, row_budget
from distbelief.runtime.shard.core import Shard


OPTIMIZER_ARRAYS = 4  # a dense slice's arrays: parameters, optimizer state, a clipped copy, a pulled copy


def attach(shard: Shard, job: Job) -> DenseSlice:
    """The shard's plugins and update hook; returns its dense slice."""
    training = job.spec.training
    dense = DenseSlice(shard, initial_slice(shard, job), optimizer=training.optimizer,
                       learning_rate=training.learning_rate, max_gradient_norm=training.max_gradient_norm,
                       max_staleness=training.max_staleness, wire_format=job.spec.parameter_servers.wire_format)
    shard.attach(dense)
    shard.watch_updates(DownpourUpdates(shard, warmstart_steps=training.warmstart_steps))
    if isinstance(job.model, EmbeddingModel):
        shard.attach(sparse_rows(shard, job, dense.params.nbytes))
    return dense


def sparse_rows(shard: Shard, job: Job, dense_bytes: int) -> SparseRows:
    """The shard's embedding rows as spec.model.embeddings and spec.training ask."""
    options, training = job.spec.model.embeddings, job.spec.training
    assert options is not None and isinstance(job.model, EmbeddingModel)
    rows = SparseRows(shard, dim=job.model.width, learning_rate=training.learning_rate, seed=training.seed,
                      admit_after=options.admit_after, expire_after=options.expire_after_seconds,
                      max_gradient_norm=training.max_gradient_norm, wide=job.model.wide, l2=options.l2,
                      wide_l2=options.wide_l2, embed_after=options.embed_after,
                      push_examples=training.batch_size * training.push_every, fields=job.model.fields,
                      optimizer=training.optimizer)
    budget = options.max_rows_per_shard
    if budget is None:
        budget = row_budget(job.spec.parameter_servers.memory_limit, rows.table.row_bytes(),
                            job.data_bytes(shard.index) + OPTIMIZER_ARRAYS * dense_bytes)
    rows.table.max_rows = budget
    shard.metrics.row_budget.set(budget or 0)
    return rows


def replica(ctx: ReplicaContext) -> ReplicaLoop:
    """An unpartitioned replica's loop. A streaming job's replica holds no data set: only
    the units the chief hands it."""
    job, training = ctx.job, ctx.job.spec.training
    sparse = isinstance(job.model, EmbeddingModel)
    dataset = None if job.spec.streams_data else job.dataset
    batches = feed.batches(ctx, training.batch_size, with_ids=sparse) if dataset is None else None
    if sparse:
        return SparseWorker(training, ctx.group, job.model, dataset, ctx.metrics, stop=ctx.stop, batches=batches)
    # spec.parameterServers.wireFormat: the operator refuses bfloat16 where only float32 works
    return Worker(training, ctx.group, job.model, dataset, ctx.metrics, stop=ctx.stop,
                  wire_format=job.spec.parameter_servers.wire_format, batches=batches)


def held_out(job: Job, group: ShardGroup) -> HeldOut | None:
    if not isinstance(job.model, EmbeddingModel):
        return None
    limit, dataset = job.spec.data.max_eval_examples, job.dataset
    return held_out_inputs(job.model, group, dataset.x_test[:limit], dataset.ids_test[:limit])
