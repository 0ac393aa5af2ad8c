"""Partitioned replicas' pods in threads, on loopback: shards that hold gradients, a
rendezvous, and pods of any partition (test_pipeline.py, test_pipeline_holds.py).

    cluster        fixture: cluster(partitions, shards) -> a started Cluster, stopped after the test
    Cluster.pod    a partition pod (FirstPartition or LaterPartition), not yet running
    run_in_thread  pod.run() in a daemon thread
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import prometheus_client as prom
import pytest

from support.shards import LiveShards, start_shards
from distbelief.runtime import jobspec
from distbelief.runtime.algorithms.pipeline import staged
from distbelief.runtime.algorithms.pipeline.rendezvous import Rendezvous, RendezvousLink
from distbelief.runtime.algorithms.pipeline.later import LaterPartition
from distbelief.runtime.algorithms.pipeline.replica import FirstPartition, PodLinks, PodSettings
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.model import data
from distbelief.runtime.model.models import Mlp
from distbelief.runtime.model.stages import plan
from distbelief.runtime.observe.metrics import WorkerMetrics
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.transport import zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.layout import Layout

TIMEOUTS = Timeouts(request=2.0, unavailable=20.0)


@dataclasses.dataclass
class Cluster:
    """Shards holding gradients, and a rendezvous, for partitioned pods in threads."""

    model: Mlp
    dataset: data.Dataset
    layout: Layout
    shards: LiveShards
    rendezvous: Rendezvous
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def params(self) -> np.ndarray:
        return np.concatenate([self.shards.params(i) for i in range(self.layout.shards)])

    def steps(self) -> list[int]:
        return [s.step for s in self.shards.shards]

    def pod(self, partition: int, stop: threading.Event | None = None, batch: int = 32, seed: int | None = None,
            micro_batches: int = 1):
        stop = stop or self.stop
        stages = plan(self.model, len(self.layout.stages) + 1).stages
        stage = stages[partition]
        own = self.layout.shards_of(stage.offset, stage.offset + stage.size)
        group = ShardGroup(self.shards.addresses, self.layout, timeouts=TIMEOUTS, stop=stop, shards=own)
        tp = zmq_transport.default()
        server = None
        if partition > 0:
            server = tp.server("tcp://127.0.0.1:*", who=f"stage {partition}",
                               max_frame=protocol.max_frame_bytes(batch * (stage.input_width + 1)), max_frames=3,
                               security=None)
        me = server.endpoint if server else f"partition-0/{group.worker_id:08x}"
        rendezvous = RendezvousLink(self.rendezvous.endpoint, partition=partition, me=me, worker_id=group.worker_id,
                                    layout=self.layout.hash, security=None, stop=stop)
        settings = PodSettings(jobspec.Training(batch_size=batch), micro_batches=micro_batches,
                               classes=self.dataset.n_classes, seed=seed)
        metrics = WorkerMetrics(prom.CollectorRegistry())
        if partition == 0:
            everyone = ShardGroup(self.shards.addresses, self.layout, timeouts=TIMEOUTS, stop=stop,
                                  worker_id=group.worker_id)
            return FirstPartition(settings, stage, PodLinks(group, rendezvous, tp, None, everyone=everyone), metrics,
                                  self.dataset, stop=stop)
        return LaterPartition(settings, stage, PodLinks(group, rendezvous, tp, None), metrics, server, stop=stop)


def start_cluster(tmp_path: Path, partitions: int, shards: int) -> Cluster:
    dataset = data.load(jobspec.Data(source="builtin:digits", test_fraction=0.2, seed=0))
    model = Mlp(dataset.n_features, dataset.n_classes, [48, 32])
    layout = Layout.of(model.shapes, shards, plan(model, partitions).boundaries)
    live = start_shards(tmp_path, layout, model.init_params(0), learning_rate=0.05, checkpoint_every=3600,
                        attach=lambda shard: shard.attach(staged.HeldGradients(shard.plugin(DenseSlice))))
    rendezvous = Rendezvous("tcp://127.0.0.1:*", partitions, layout.hash, security=None,
                            finished=lambda: False).start()
    return Cluster(model, dataset, layout, live, rendezvous)


@pytest.fixture
def cluster(tmp_path: Path):
    made: list[Cluster] = []

    def make(partitions: int, shards: int) -> Cluster:
        made.append(start_cluster(tmp_path, partitions, shards))
        return made[-1]
    yield make
    for c in made:
        c.stop.set()
        c.rendezvous.stop()
        c.shards.stop()


def run_in_thread(pod) -> threading.Thread:
    thread = threading.Thread(target=pod.run, daemon=True)
    thread.start()
    return thread
