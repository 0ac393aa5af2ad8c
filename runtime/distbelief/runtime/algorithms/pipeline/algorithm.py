"""The hooks of a partitioned Downpour job (spec.model.partitions > 1, interface.py): what
its shards add to the dense slice, what runs beside the chief, and its pods' loop.

Each shard holds gradients until their step commits (staged.py); the rendezvous beside
shard 0 forms replica groups (rendezvous.py); a pod runs its partition's stage
(replica.py). registry.py uses these for Downpour jobs with a plan.
"""

from __future__ import annotations

from distbelief.runtime.algorithms.feed import hooks as feed
from distbelief.runtime.algorithms.interface import ChiefContext, ReplicaContext, ReplicaLoop
from distbelief.runtime.algorithms.pipeline.rendezvous import Rendezvous, RendezvousLink
from distbelief.runtime.algorithms.pipeline.later import LaterPartition
from distbelief.runtime.algorithms.pipeline.replica import FirstPartition, PodLinks, PodSettings
from distbelief.runtime.algorithms.pipeline.staged import HeldGradients
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.shard.core import Shard
from distbelief.runtime.transport import zmq_transport
from distbelief.runtime.wire import protocol


def attach(shard: Shard, dense: DenseSlice) -> None:
    """Gradients held on the shard's dense slice until partition 0 applies their step."""
    shard.attach(HeldGradients(dense))


def beside_chief(ctx: ChiefContext) -> Rendezvous:
    """The rendezvous; when the job streams its files, serving the dispenser on its port too."""
    dispenser = feed.dispenser(ctx, position_dir=ctx.output_dir, serve=False) if ctx.job.spec.streams_data else None
    return Rendezvous(ctx.coordinator_bind, len(ctx.job.plan.stages), ctx.job.layout.hash,
                      security=ctx.server_security, finished=lambda: ctx.shard.finished is not None,
                      dispenser=dispenser).start()


def replica(ctx: ReplicaContext) -> ReplicaLoop:
    """A pod of a partitioned replica (spec.model.partitions > 1): its stage of the model."""
    job, access, group = ctx.job, ctx.stage, ctx.group
    training = job.spec.training
    assert job.plan is not None, "a pod of a partitioned replica"
    stage = job.plan.stages[access.partition]
    settings = PodSettings(training, micro_batches=job.spec.model.micro_batches, classes=job.n_classes)
    me = access.address or f"partition-0/{group.worker_id:08x}"  # partition 0 serves nothing: a name will do
    rendezvous = RendezvousLink(job.config.coordinator_address(), partition=access.partition, me=me,
                                worker_id=group.worker_id, layout=job.layout.hash, security=ctx.client_security,
                                stop=ctx.stop)
    tp = zmq_transport.default()
    if access.partition == 0:
        own = group.subgroup(job.stage_shards(0))  # reached as every shard is: their copies too
        links = PodLinks(own, rendezvous, tp, access.client, everyone=group)
        if job.spec.streams_data:  # only partition 0 reads the data; the labels go down with each step
            return FirstPartition(settings, stage, links, ctx.metrics, None, stop=ctx.stop,
                                  batches=feed.batches(ctx, training.batch_size))
        return FirstPartition(settings, stage, links, ctx.metrics, job.dataset, stop=ctx.stop)
    values = training.batch_size * (stage.input_width + 1)
    server = tp.server(access.bind, who=f"stage {access.partition}", max_frame=protocol.max_frame_bytes(values),
                       max_frames=3, security=access.server)
    return LaterPartition(settings, stage, PodLinks(group, rendezvous, tp, access.client), ctx.metrics, server,
                          stop=ctx.stop)
