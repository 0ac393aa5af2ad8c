#!/usr/bin/env python
"""Sparse embedding tables: touched rows per second, bytes per step, held-out AUC.

    python benchmarks/sparse_bench.py [--runs 3] [--json benchmarks/results.json]

Figures (each a median with min and max over --runs), merged into --json under "sparse":

  shard_rows_per_s    rows one shard's table (rowtable.RowTable) updates per second:
                      row-wise Adagrad on SHARD_BATCH unique Zipf keys per push, over a table
                      of SHARD_ROWS rows (in process: the table's arithmetic, no network)
  shard_pull_rows_per_s   the same for reading rows (SPARSE_PULL's work)
  rows_per_s_e2e      rows moved end to end by the ctr-sparse example (local mode, 2 shard
                      and 2 replica processes): steps/s x the mean unique keys of a
                      minibatch (each pulled, then pushed)
  bytes_per_step      measured ShardGroup bytes of one minibatch's SPARSE_PULL + SPARSE_PUSH
                      (live shards in this process), against dense_bytes_per_step: the same
                      table kept dense (fields x ids rows) pulled and pushed whole
  auc, auc_baseline   the example's held-out AUC, and scikit-learn's LogisticRegression on
                      one-hot ids of the same split and the same held-out examples

The 800M-parameter table (50M rows x 16 over 4 shards: sparse.rss_bytes_total,
sparse.params, sparse.fill_rows_per_s) is sparse_table_bench.py's.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import prometheus_client as prom

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from figures import save_group, summarize

from distbelief.operator.local import local, report
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime.client.group import ShardGroup
from distbelief.runtime.model import models
from distbelief.runtime.model.embedding import EmbeddingModel
from distbelief.runtime.model.job import Job
from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.params.rows.row_client import RowClient
from distbelief.runtime.params.rows.rowtable import RowTable
from distbelief.runtime.params.rows.sparse import SparseRows
from distbelief.runtime.shard.core import Shard, ShardSettings

EXAMPLE = HERE.parent / "examples" / "ctr-sparse.yaml"
SHARD_ROWS, SHARD_BATCH, DIM = 1_000_000, 16_384, 16
CALLS = 20


def shard_rates(rng: np.random.Generator) -> tuple[float, float]:
    """(updated rows/s, read rows/s) of one table holding SHARD_ROWS rows."""
    table = RowTable(DIM, learning_rate=0.05, seed=0)
    keys = np.arange(SHARD_ROWS, dtype=np.int64) * 7919
    table.update(keys, np.zeros((SHARD_ROWS, DIM), np.float32), now=0.0)
    batches = [np.unique(keys[np.minimum(rng.zipf(1.1, SHARD_BATCH * 2), SHARD_ROWS) - 1])[:SHARD_BATCH]
               for _ in range(CALLS)]
    grads = np.ones((SHARD_BATCH, DIM), np.float32)
    rows = sum(b.size for b in batches)
    started = time.perf_counter()
    for batch in batches:
        table.update(batch, grads[: batch.size], now=1.0)
    push = rows / (time.perf_counter() - started)
    started = time.perf_counter()
    for batch in batches:
        table.rows(batch)
    return push, rows / (time.perf_counter() - started)


def unique_keys_per_step(job: Job, rng: np.random.Generator) -> float:
    model, ids = job.model, job.dataset.ids_train
    assert isinstance(model, EmbeddingModel) and ids is not None
    batch = job.spec.training.batch_size
    return float(np.mean([model.keys(ids[rng.choice(len(ids), batch, replace=False)])[0].size for _ in range(50)]))


def example_run(output: Path) -> dict:
    (doc,) = spec.load_manifests(str(EXAMPLE))
    started = time.monotonic()
    code = local.LocalRun(DistBeliefJob.validated(doc), str(output)).run(progress=False)
    if code != 0:
        raise RuntimeError(f"the example ended with exit code {code}")
    summary = json.loads((output / report.REPORT_FILE).read_text())
    summary["launchSeconds"] = time.monotonic() - started
    return summary


def bytes_per_step(job: Job, folder: Path, rng: np.random.Generator) -> float:
    """Measured bytes (both ways) of one minibatch's rows pulled and pushed over live shards."""
    model = job.model
    assert isinstance(model, EmbeddingModel) and job.dataset.ids_train is not None
    shards, threads = [], []
    for index in range(job.layout.shards):
        shard = Shard(ShardSettings(shard=index, bind="tcp://127.0.0.1:*", checkpoint_dir=str(folder / str(index)),
                                    checkpoint_every=3600), job.layout, ShardMetrics(prom.CollectorRegistry(), index))
        shard.attach(SparseRows(shard, dim=model.width, learning_rate=0.05, seed=0, wide=model.wide))
        threads.append(threading.Thread(target=shard.serve, daemon=True))
        threads[-1].start()
        shard.ready.wait(10)
        shards.append(shard)
    group = ShardGroup([s.endpoint for s in shards], job.layout)
    try:
        client, ids, samples = RowClient(group, model.width), job.dataset.ids_train, []
        for _ in range(20):
            keys, _ = model.keys(ids[rng.choice(len(ids), job.spec.training.batch_size, replace=False)])
            before = group.bytes_in + group.bytes_out
            rows, _ = client.pull(keys)
            client.push(keys, np.zeros_like(rows))
            samples.append(group.bytes_in + group.bytes_out - before)
        return float(np.median(samples))
    finally:
        group.close()
        for shard, thread in zip(shards, threads):
            shard.stop()
            thread.join(timeout=30)  # its final checkpoint is written before the folder goes


def logistic_baseline_auc(job: Job, held_out: int) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import OneHotEncoder

    ds = job.dataset
    encoder = OneHotEncoder(handle_unknown="ignore")
    train = encoder.fit_transform(ds.ids_train)
    test_ids, y_test = ds.ids_test[:held_out], ds.y_test[:held_out]
    fitted = LogisticRegression(C=1.0, max_iter=2000).fit(train, ds.y_train)
    auc = models.auc(fitted.decision_function(encoder.transform(test_ids)), y_test)
    assert auc is not None
    return auc


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    (doc,) = spec.load_manifests(str(EXAMPLE))
    job = Job(spec.job_config(spec.validate_job(doc)))
    shard = [shard_rates(rng) for _ in range(args.runs)]
    keys_per_step = unique_keys_per_step(job, rng)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            runs.append(example_run(Path(tmp) / f"run{i}"))
        measured_bytes = bytes_per_step(job, Path(tmp) / "bytes", rng)
    batch = job.spec.training.batch_size
    fields, ids = job.model.fields, int(doc["spec"]["data"]["source"].split("ids=")[1].split(",")[0])
    dense_bytes = 2 * fields * ids * job.model.width * 4
    results = {
        "shard_rows_per_s": summarize([s[0] for s in shard]),
        "shard_pull_rows_per_s": summarize([s[1] for s in shard]),
        "rows_per_s_e2e": summarize([r["examplesPerSecond"] / batch * keys_per_step for r in runs]),
        "unique_keys_per_step": keys_per_step,
        "bytes_per_step": measured_bytes,
        "dense_bytes_per_step": dense_bytes,
        "bytes_ratio_dense_over_sparse": dense_bytes / measured_bytes,
        "auc": summarize([r["auc"] for r in runs]),
        "auc_baseline": logistic_baseline_auc(job, job.spec.data.max_eval_examples),
        "definition": {"shard": f"{SHARD_ROWS} rows x {DIM}, {SHARD_BATCH} unique Zipf(1.1) keys a push",
                       "e2e": "examples/ctr-sparse.yaml, local mode, 2 shards, 2 replicas"},
    }
    print(json.dumps(results, indent=2))
    save_group(results, "sparse", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
