"""Bounded row tables: a push declares no more occurrences than its examples could hold, and
a shard's rows stay within their budget (evicted by the expiry policy, or refused and
counted), through the real protocol on live shards."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from distbelief.runtime import errors, jobspec
from distbelief.runtime.algorithms.downpour import algorithm as downpour
from distbelief.runtime.params.rows import sparse
from distbelief.runtime.params.rows.row_client import RowClient
from distbelief.runtime.params.rows.rowtable import RowTable
from distbelief.runtime.params.rows.sparse import SparseRows
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.protocol import Status
from distbelief.runtime.wire.rowkeys import owner_of

from support.shards import LiveShards, start_row_shards, start_shards

DIM, SEED = 4, 11
LAYOUT = Layout.of([("w", (10, 7)), ("b", (7,))], shards=2)
BATCH, FIELDS = 256, 12   # a push's examples and ids per example, as batchSize x pushEvery and the data's fields


def _start(folder: Path, **options: object) -> LiveShards:
    return start_row_shards(folder, LAYOUT, dim=DIM, learning_rate=0.1, seed=SEED, push_examples=BATCH, fields=FIELDS,
                            **options)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveShards]:
    shards = _start(tmp_path)
    yield shards
    shards.stop()


def _mine(n: int, seed: int = 0) -> np.ndarray:
    """n keys that shard 0 owns."""
    keys = np.unique(np.random.default_rng(seed).integers(0, 2**62, 4 * n, dtype=np.int64))
    return keys[owner_of(keys, 2) == 0][:n]


def _table(live: LiveShards) -> RowTable:
    return live.shards[0].plugin(SparseRows).table


def test_a_push_of_more_keys_than_its_examples_hold_is_refused_and_grows_nothing(live: LiveShards) -> None:
    # The attack: pushes of 2**18 keys each, every key declared to occur often
    # enough to be admitted at once. A push's keys are at most batch x fields.
    keys = _mine(BATCH * FIELDS + 1)
    with pytest.raises(errors.ShardRefused, match="more than a push's examples can hold"):
        RowClient(live.group(), DIM).push(keys, np.zeros((keys.size, DIM), np.float32), np.full(keys.size, 10**6))
    assert _table(live).n == 0
    assert live.shards[0].metrics.rejected._value.get() == 1
    ok = RowClient(live.group(), DIM).push(keys[:-1], np.zeros((keys.size - 1, DIM), np.float32))
    assert ok[0].header.status == Status.OK and _table(live).n == keys.size - 1


def test_declared_occurrences_are_cut_to_what_a_push_can_hold(tmp_path: Path) -> None:
    live = _start(tmp_path, admit_after=1000)
    try:
        key = _mine(1)
        client = RowClient(live.group(), DIM)
        for _ in range(3):  # a million declared each time, 256 counted: 768 < 1000
            client.push(key, np.ones((1, DIM), np.float32), np.array([10**6]))
        assert _table(live).n == 0
        client.push(key, np.ones((1, DIM), np.float32), np.array([10**6]))  # 1024: admitted
        assert _table(live).n == 1
    finally:
        live.stop()


def test_at_the_budget_new_rows_are_refused_and_counted_and_old_ones_still_learn(tmp_path: Path) -> None:
    live = _start(tmp_path, max_rows=1024)
    try:
        keys = _mine(3000)
        client = RowClient(live.group(), DIM)
        for chunk in np.array_split(keys, 3):  # 1000 keys a push: the third push overflows
            client.push(chunk, np.ones((chunk.size, DIM), np.float32))
        table = _table(live)
        assert table.n == 1024 and table.refused == 3000 - 1024
        assert live.shards[0].metrics.rows_refused._value.get() == 3000 - 1024
        assert live.shards[0].metrics.rows._value.get() == 1024
        before = table.rows(keys[:5]).copy()
        client.push(keys[:5], np.ones((5, DIM), np.float32))  # rows held still train
        assert (table.rows(keys[:5]) < before).all()
        stats = live.group().stats()[0]
        assert (stats["rows"], stats["rowBudget"], stats["rowsRefused"], stats["rowsEvicted"]) == (1024, 1024, 1976, 0)
    finally:
        live.stop()


def test_at_the_budget_with_expiry_the_least_recently_pushed_rows_are_evicted(tmp_path: Path) -> None:
    live = _start(tmp_path, max_rows=1024, expire_after=3600.0)
    try:
        old, new = _mine(1024, seed=1), _mine(200, seed=2)
        new = new[~np.isin(new, old)]
        client = RowClient(live.group(), DIM)
        for chunk in np.array_split(old, 2):
            client.push(chunk, np.ones((chunk.size, DIM), np.float32))
        table = _table(live)
        table.touched[:512] -= 100  # the first half was pushed longer ago
        client.push(new, np.ones((new.size, DIM), np.float32))
        assert table.n <= 1024 and table.refused == 0
        assert table.evicted == new.size + 1024 // 16  # what the push needed, and a sixteenth of the budget
        assert (table.lookup(new) >= 0).all()
        gone = table.lookup(old[np.isin(old, table.keys[: table.n], invert=True)])
        assert (gone == -1).all() and gone.size == table.evicted
        assert live.shards[0].metrics.rows_evicted._value.get() == table.evicted
    finally:
        live.stop()


def test_the_default_budget_is_half_of_what_the_memory_limit_leaves() -> None:
    row_bytes = RowTable(9, learning_rate=0.1, seed=0, wide=2, l2=1e-3, embed_after=5).row_bytes()
    assert 60 < row_bytes < 90
    budget = sparse.row_budget("2Gi", row_bytes, other_bytes=100 << 20)
    assert budget == int(((2 << 30) - sparse.PROCESS_BYTES - (100 << 20)) / 2 / row_bytes)
    assert sparse.row_budget(None, row_bytes, 0) is None
    assert sparse.row_budget("100Mi", row_bytes, 0) == sparse.MIN_BUDGET  # never below the minimum


def _limits(memory: str | None) -> dict:
    return {"limits": {"memory": memory}} if memory else {}


class _Job:
    """What downpour.sparse_rows reads of a job."""

    def __init__(self, embeddings: jobspec.Embeddings, memory_limit: str | None) -> None:
        from distbelief.runtime.model import data, embedding
        self.dataset = data.split(np.zeros((100, 0), np.float32), np.arange(100) % 2, test_fraction=0.2, seed=0,
                                  ids=np.arange(300).reshape(100, 3))
        model = jobspec.Model(hidden_layers=(), embeddings=embeddings)
        self.model = embedding.build(model, self.dataset)
        self.spec = jobspec.JobSpec(data=jobspec.Data(source="npz:/none.npz"), model=model,
                                    training=jobspec.Training(batch_size=32),
                                    parameter_servers=jobspec.ParameterServers(resources=_limits(memory_limit)))

    def data_bytes(self, shard: int) -> int:
        return self.dataset.nbytes   # loaded whole in every shard


@pytest.mark.parametrize("embeddings, limit, budget", [
    (jobspec.Embeddings(dim=4), "1Gi", "derived"),
    (jobspec.Embeddings(dim=4, max_rows_per_shard=5000), "1Gi", 5000),
    (jobspec.Embeddings(dim=4), None, None),
])
def test_a_shards_budget_is_the_spec_s_or_derived_from_its_memory_limit(tmp_path: Path, embeddings: jobspec.Embeddings,
                                                                         limit: str | None, budget: object) -> None:
    seen = {}

    def attach(shard) -> None:
        job = _Job(embeddings, limit)
        rows = downpour.sparse_rows(shard, job, dense_bytes=1000)
        shard.attach(rows)
        seen["rows"], seen["job"] = rows, job
    live = start_shards(tmp_path, LAYOUT, np.zeros(LAYOUT.total, np.float32), attach=attach, checkpoint_every=3600)
    try:
        table, job = seen["rows"].table, seen["job"]
        if budget == "derived":
            assert table.max_rows == sparse.row_budget("1Gi", table.row_bytes(),
                                                       job.dataset.nbytes + downpour.OPTIMIZER_ARRAYS * 1000)
            assert 1_000_000 < table.max_rows < 10_000_000
        else:
            assert table.max_rows == budget
        assert seen["rows"].push_keys == 32 * 3  # batchSize x pushEvery (1) x fields
    finally:
        live.stop()


@pytest.mark.slow
def test_a_job_at_its_row_budget_ends_with_the_condition_row_budget_reached(tmp_path: Path) -> None:
    import json

    from distbelief.operator.local import local, report
    from distbelief.operator.validation.job import DistBeliefJob

    from support.examples import load_example
    doc = load_example("ctr-sparse.yaml")
    doc["spec"]["model"]["embeddings"]["maxRowsPerShard"] = 1024
    doc["spec"]["training"]["maxSteps"] = 300
    code = local.LocalRun(DistBeliefJob.validated(doc), str(tmp_path)).run(progress=False)
    summary = json.loads((tmp_path / report.REPORT_FILE).read_text())
    assert code == 0 and summary["phase"] == "Succeeded"
    (warning,) = [w for w in summary["warnings"] if w["type"] == "RowBudgetReached"]
    # The example's rows expire after an hour: at the budget the least recently pushed go early.
    assert warning["reason"] == "RowsEvicted" and "row budget of 1,024 rows" in warning["message"]
    assert "rows evicted, those pushed to least recently first" in warning["message"]
    history = [json.loads(line) for line in
               (tmp_path / "volumes" / "ctr-sparse-ps-0" / "checkpoints" / "history.jsonl").read_text().splitlines()]
    assert max(row["rows"] for row in history) <= 1024  # shard 0's table never grew past it
    assert summary["auc"] > 0.6
