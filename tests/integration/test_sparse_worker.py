"""A sparse replica's rows under fetchEvery and pushEvery, against live shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import prometheus_client as prom

from distbelief.runtime.algorithms.downpour.sparse_worker import SparseWorker
from distbelief.runtime import jobspec
from distbelief.runtime.model import data, models
from distbelief.runtime.model.embedding import EmbeddingModel
from distbelief.runtime.observe.metrics import WorkerMetrics
from distbelief.runtime.params.rows.sparse import SparseRows
from distbelief.runtime.wire.layout import Layout

from support.shards import LiveShards, start_shards

DIM, STEPS = 4, 6


class Recorded:
    """A SparseWorker whose steps' keys, row gradients, pulls and pushes are written down;
    it stops after STEPS minibatches."""

    def __init__(self, folder: Path, *, fetch_every: int = 1, push_every: int = 1) -> None:
        x, y, ids = data.read_source("synthetic-ctr:fields=3,ids=200,samples=600,zipf=1.2,seed=4")
        dataset = data.split(x, y, ids=ids, test_fraction=0.2, seed=0)
        model = EmbeddingModel(models.Mlp(3 * DIM, 2), dense_features=0, fields=3, dim=DIM)
        layout = Layout.of(model.shapes, shards=2)
        self.live: LiveShards = start_shards(
            folder, layout, model.init_params(0), checkpoint_every=3600,
            attach=lambda shard: shard.attach(SparseRows(shard, dim=DIM, learning_rate=0.05, seed=3)))
        training = jobspec.Training(batch_size=32, fetch_every=fetch_every, push_every=push_every)
        self.worker = SparseWorker(training, self.live.group(), model, dataset, WorkerMetrics(prom.CollectorRegistry()),
                                   seed=1)
        self.steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # keys, each key's count, row grads
        self.pulls: list[np.ndarray] = []
        self.pushes: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._wrap()

    def _wrap(self) -> None:
        w = self.worker
        keys_of, pull, push, add = w.embedding.keys, w.rows.pull, w.rows.push, w.unpushed.add

        def keys(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            unique, index = keys_of(ids)
            counts = np.array([(index == i).sum() for i in range(unique.size)])
            self.steps.append((unique, counts, np.empty(0)))
            return unique, index

        def added(keys: np.ndarray, grads: np.ndarray, occurrences: np.ndarray) -> None:
            self.steps[-1] = (*self.steps[-1][:2], grads.copy())
            add(keys, grads, occurrences)
            if len(self.steps) == STEPS:
                w.stop_requested.set()

        w.embedding.keys = keys  # type: ignore[method-assign]
        w.rows.pull = lambda k: (self.pulls.append(k.copy()), pull(k))[1]  # type: ignore[method-assign]
        w.rows.push = lambda k, g, o: (self.pushes.append((k, g, o)), push(k, g, o))[1]  # type: ignore[method-assign]
        w.unpushed.add = added  # type: ignore[method-assign]

    def run(self) -> None:
        try:
            assert self.worker.run() == "stopped"
        finally:
            self.live.stop()


def test_with_push_every_the_rows_gradients_are_summed_per_key_and_pushed_together(tmp_path: Path) -> None:
    recorded = Recorded(tmp_path, push_every=3)
    recorded.run()
    assert len(recorded.pushes) == STEPS // 3
    for window, (keys, grads, occurrences) in enumerate(recorded.pushes):
        steps = recorded.steps[3 * window: 3 * window + 3]
        every = np.concatenate([s[0] for s in steps])
        np.testing.assert_array_equal(keys, np.unique(every))  # deduplicated over the window
        assert keys.size < every.size  # the window's minibatches shared keys
        for i, key in enumerate(keys):
            held = [(s[2][s[0] == key], s[1][s[0] == key]) for s in steps]
            np.testing.assert_allclose(grads[i], sum(g.sum(axis=0) for g, _ in held), rtol=1e-5, atol=1e-7)
            assert occurrences[i] == sum(int(c.sum()) for _, c in held)


def test_with_fetch_every_held_rows_are_reused_and_only_new_keys_pulled(tmp_path: Path) -> None:
    recorded = Recorded(tmp_path, fetch_every=3)
    recorded.run()
    pulled = iter(recorded.pulls)
    for window in range(STEPS // 3):
        held = np.empty(0, np.int64)
        for keys, _, _ in recorded.steps[3 * window: 3 * window + 3]:
            new = np.setdiff1d(keys, held)
            if new.size:  # a step whose keys are all held pulls nothing
                np.testing.assert_array_equal(np.sort(next(pulled)), new)
            held = np.union1d(held, keys)
    assert next(pulled, None) is None
    assert sum(p.size for p in recorded.pulls) < sum(s[0].size for s in recorded.steps)
    assert len(recorded.pushes) == STEPS  # rows still pushed every step (pushEvery 1)


def test_with_both_at_one_every_step_pulls_and_pushes_all_its_keys(tmp_path: Path) -> None:
    recorded = Recorded(tmp_path)
    recorded.run()
    assert len(recorded.pulls) == len(recorded.pushes) == STEPS
    for (keys, counts, _), pulled, (pushed, _, occurrences) in zip(recorded.steps, recorded.pulls, recorded.pushes):
        np.testing.assert_array_equal(pulled, keys)
        np.testing.assert_array_equal(pushed, keys)
        np.testing.assert_array_equal(occurrences, counts)
