"""The feed's parts as the roles start them: the dispenser beside shard 0, a replica's stream."""

from __future__ import annotations

import threading

import numpy as np

from distbelief.runtime.algorithms.feed.dispenser import Dispenser, DispenserSettings
from distbelief.runtime.algorithms.feed.ops import DispenserLink
from distbelief.runtime.algorithms.feed.stream import BUFFER_EXAMPLES, StreamedBatches
from distbelief.runtime.algorithms.interface import ChiefContext, ReplicaContext
from distbelief.runtime.model.files import FileSet
from distbelief.runtime.observe.metrics import DispenserMetrics


def dispenser(ctx: ChiefContext, *, position_dir: str | None, serve: bool = True) -> Dispenser:
    """Its position is recorded in (and resumed from) position_dir. serve: started on the
    coordinator port; else another server there hands it its requests (handle, tick)."""
    job = ctx.job
    assert job.files is not None, "only a job whose replicas stream files has a dispenser"
    settings = DispenserSettings(bind=ctx.coordinator_bind, units=len(job.files.train_units), seed=job.spec.data.seed,
                                 layout=job.layout.hash, position_dir=position_dir, security=ctx.server_security)
    server = Dispenser(settings, stop=threading.Event(), is_done=lambda: ctx.shard.finished is not None)
    DispenserMetrics(ctx.registry, lambda: server.units.epochs)
    return server.start() if serve else server


def batches(ctx: ReplicaContext, batch_size: int, *, with_ids: bool = False) -> StreamedBatches:
    """The replica's minibatches from the units the dispenser hands it; with_ids: (x, y, ids)
    minibatches, for a model with embeddings."""
    job = ctx.job
    assert job.files is not None, "only a job whose replicas stream files streams"
    link = DispenserLink(job.config.coordinator_address(), worker_id=ctx.group.worker_id, layout=job.layout.hash,
                         security=ctx.client_security, stop=ctx.stop)
    return StreamedBatches(job.files, link, batch_size, np.random.default_rng(), stop=ctx.stop,
                           skip_bad=job.spec.data.on_bad_file == "skip",
                           buffer_examples=buffer_examples(job.files, batch_size), with_ids=with_ids)


def buffer_examples(file_set: FileSet, batch_size: int) -> int:
    """The shuffle buffer's fill: BUFFER_EXAMPLES, or an eighth of a small data set (rows known
    from Parquet's metadata), so that a replica does not hoard the units of several epochs."""
    rows = sum(unit.rows for unit in file_set.train_units)
    return min(BUFFER_EXAMPLES, max(4 * batch_size, rows // 8)) if rows else BUFFER_EXAMPLES
