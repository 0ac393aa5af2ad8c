"""A shard holding only embedding rows, driven from the test's thread (not serving): its
table, its steps and checkpoints, and the fixed keys of each numbered step, so any run can
be replayed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import prometheus_client as prom

from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.params.rows import rowcheckpoint
from distbelief.runtime.params.rows.rowtable import RowTable
from distbelief.runtime.params.rows.sparse import SparseRows
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.core import Shard, ShardSettings
from distbelief.runtime.wire.layout import Layout

DIM, SEED, LR, KEEP = 4, 5, 0.3, 3
FULL_ROWS = 100  # tables of more rows are written as a base and deltas
LAYOUT = Layout.of([("w", (2,))], shards=1)


def make_shard(folder: Path, dim: int = DIM, row_bytes: int = (DIM + 5) * 4, *, index: int = 0,
               layout: Layout = LAYOUT, **options: object) -> Shard:
    """Shard `index` of layout with only the rows plugin, restored from folder; not serving:
    the tests drive its table and its checkpoints from this thread. Tables over FULL_ROWS
    rows of row_bytes are written as a base and deltas."""
    shard = Shard(ShardSettings(shard=index, bind="tcp://127.0.0.1:*", checkpoint_dir=str(folder),
                                checkpoint_every=1e9, checkpoint_keep=KEEP), layout,
                  ShardMetrics(prom.CollectorRegistry(), index))
    shard.attach(SparseRows(shard, dim=dim, learning_rate=LR, seed=SEED,
                            full_write_bytes=FULL_ROWS * row_bytes, **options))
    shard.restore()
    return shard


def table(shard: Shard) -> RowTable:
    return shard.plugin(SparseRows).table


def push(shard: Shard, keys: np.ndarray, now: float = 1000.0) -> None:
    grads = np.cos(keys[:, None] + shard.step + np.arange(DIM)).astype(np.float32)
    table(shard).update(keys, grads, now)


def step(shard: Shard, keys: np.ndarray, now: float = 1000.0) -> None:
    """One update of keys, then a checkpoint at the next step."""
    push(shard, keys, now)
    shard.step += 1
    shard.checkpoint_now()


def snapshot(t: RowTable) -> dict[int, tuple]:
    return {int(k): (t.values[i].tobytes(), float(t.accumulators[i])) for i, k in enumerate(t.keys[: t.n])}


def row_files(folder: Path) -> set[str]:
    rows = folder / rowcheckpoint.FOLDER
    return {p.name for p in rows.iterdir()} if rows.exists() else set()


def named_files(folder: Path) -> set[str]:
    return {e["file"] for path in checkpoint.list_checkpoints(str(folder))
            for e in checkpoint.read_meta(path).get(rowcheckpoint.CHAIN, [])}


def keys_of_step(number: int) -> np.ndarray:
    """The keys a step updates: fixed by its number, so any run can be replayed."""
    rng = np.random.default_rng(number)
    return np.unique(rng.integers(0, 3000 if number > 1 else 600, 400 if number == 1 else 60))


def replay(steps: int) -> dict[int, tuple]:
    t = RowTable(DIM, learning_rate=LR, seed=SEED)
    for number in range(1, steps + 1):
        keys = keys_of_step(number)
        t.update(keys, np.cos(keys[:, None] + (number - 1) + np.arange(DIM)).astype(np.float32), 1000.0)
    return snapshot(t)
