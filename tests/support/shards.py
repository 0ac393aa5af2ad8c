"""Live shards on loopback in this process (threads serving tcp://127.0.0.1), as Downpour runs them."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import prometheus_client as prom

from distbelief.runtime.algorithms.downpour.updates import DownpourUpdates
from distbelief.runtime.algorithms.sandblaster.vectors import ShardVectors
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.params.rows.sparse import SparseRows
from distbelief.runtime.shard.core import Shard, ShardSettings
from distbelief.runtime.wire.layout import Layout


@dataclasses.dataclass
class LiveShards:
    """Shards serving in threads; stop() ends them (each writes a final checkpoint)."""

    layout: Layout
    shards: list[Shard]
    threads: list[threading.Thread]

    @property
    def addresses(self) -> list[str]:
        return [s.endpoint for s in self.shards]

    def group(self, **kwargs: Any) -> ShardGroup:
        kwargs.setdefault("timeouts", Timeouts(request=2.0, unavailable=10.0))
        return ShardGroup(self.addresses, self.layout, **kwargs)

    def params(self, index: int) -> np.ndarray:
        """Shard index's dense slice, as it is now."""
        return self.shards[index].plugin(DenseSlice).params

    def stop(self) -> None:
        for shard in self.shards:
            shard.stop()
        for thread in self.threads:
            thread.join(timeout=10)


def start_shards(folder: Path, layout: Layout, initial: np.ndarray, *,
                 attach: Callable[[Shard], None] = lambda shard: None, **settings: Any) -> LiveShards:
    """Downpour's shards: a dense slice of initial and Downpour's update hook (warm-start with
    warmstart_steps), and whatever attach adds to each."""
    warmstart_steps = settings.pop("warmstart_steps", 0)
    optimizer = {"optimizer": settings.pop("optimizer", "adagrad"), "learning_rate": settings.pop("learning_rate", 0.1),
                 "max_gradient_norm": settings.pop("max_gradient_norm", 1e4),
                 "wire_format": settings.pop("wire_format", "float32")}

    def downpour(shard: Shard) -> None:
        shard.attach(DenseSlice(shard, initial, **optimizer))
        shard.watch_updates(DownpourUpdates(shard, warmstart_steps=warmstart_steps))
        attach(shard)
    return serve_shards(folder, layout, downpour, **settings)


def start_vector_shards(folder: Path, layout: Layout, initial: np.ndarray, history: int) -> LiveShards:
    """Sandblaster's shards: a dense slice of initial that takes no push, and the L-BFGS
    vectors of `history` steps beside it."""
    def sandblaster(shard: Shard) -> None:
        dense = DenseSlice(shard, initial, optimizer="adagrad", learning_rate=0.1, pushes=False)
        shard.attach(dense)
        shard.attach(ShardVectors(shard, dense, history))
    return serve_shards(folder, layout, sandblaster, checkpoint_every=3600)


def serve_shards(folder: Path, layout: Layout, attach: Callable[[Shard], None], **settings: Any) -> LiveShards:
    """Every shard of layout, with what attach gives each, restored from folder/shard-N and
    serving from a thread of its own."""
    shards, threads = [], []
    for index in range(layout.shards):
        options = {"bind": "tcp://127.0.0.1:*", "checkpoint_dir": str(folder / f"shard-{index}"), **settings}
        shard = Shard(ShardSettings(shard=index, **options), layout, ShardMetrics(prom.CollectorRegistry(), index))
        attach(shard)
        shard.restore()
        thread = threading.Thread(target=shard.serve, daemon=True)
        thread.start()
        assert shard.ready.wait(10), "shard did not start"
        shards.append(shard)
        threads.append(thread)
    return LiveShards(layout, shards, threads)


def start_row_shards(folder: Path, layout: Layout, **rows: Any) -> LiveShards:
    """start_shards at zero parameters, each shard with embedding rows (SparseRows(**rows))."""
    return start_shards(folder, layout, np.zeros(layout.total, np.float32), checkpoint_every=3600,
                        attach=lambda shard: shard.attach(SparseRows(shard, **rows)))
