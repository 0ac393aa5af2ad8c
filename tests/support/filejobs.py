"""A job on Parquet files of a linear teacher's labels: what the file-source tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FEATURES, CLASSES = 8, 3


def write_teacher_parquet(folder: Path, *, files: int = 5, per_file: int = 2000, group: int = 500) -> None:
    """Gaussian features labelled by a fixed linear teacher (as synthetic: data), in files."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(7)
    teacher = rng.standard_normal((FEATURES, CLASSES))
    for k in range(files):
        x = rng.standard_normal((per_file, FEATURES)).astype(np.float32)
        columns = {f"f{i}": x[:, i] for i in range(FEATURES)}
        columns["y"] = np.argmax(x @ teacher, axis=1)
        pq.write_table(pa.table(columns), folder / f"part-{k:02d}.parquet", row_group_size=group)


def job(source: str, **data: Any) -> dict[str, Any]:
    return {"apiVersion": "distbelief.io/v1alpha1", "kind": "DistBeliefJob", "metadata": {"name": "files"},
            "spec": {"model": {"type": "softmax"}, "data": {"source": source, **data},
                     "training": {"batchSize": 32, "learningRate": 0.1, "maxSteps": 20000, "targetAccuracy": 0.95,
                                  "maxDuration": "4m", "evalEverySeconds": 0.5},
                     "parameterServers": {"shards": 1, "checkpoint": {"everySeconds": 2}},
                     "workers": {"replicas": 2}}}


CTR_FIELDS = 4


def write_ctr_parquet(folder: Path, *, files: int = 8, per_file: int = 2000, group: int = 500,
                      seed: int = 3) -> np.ndarray:
    """Click-style rows (as synthetic-ctr: data) in files: id columns c0..c3, label y and a
    dense column `noise`; returns the planted model's logit of each row, in file order."""
    from distbelief.runtime.model import data

    folder.mkdir(parents=True)
    ids, y, logits = data.synthetic_ctr(f"fields={CTR_FIELDS},ids=300,samples={files * per_file},zipf=1.1,seed={seed}")
    noise = np.random.default_rng(seed).standard_normal(len(y))
    for k in range(files):
        rows = slice(k * per_file, (k + 1) * per_file)
        columns = {f"c{f}": ids[rows, f] for f in range(CTR_FIELDS)}
        columns.update(noise=noise[rows], y=y[rows])
        pq.write_table(pa.table(columns), folder / f"part-{k:02d}.parquet", row_group_size=group)
    return logits


def sparse_job(source: str, **data: Any) -> dict[str, Any]:
    """A job with embeddings over write_ctr_parquet's id columns."""
    doc = job(source, ids=[f"c{f}" for f in range(CTR_FIELDS)], **data)
    doc["spec"]["model"] = {"type": "mlp", "hiddenLayers": [], "embeddings": {"dim": 8}}
    doc["spec"]["training"].update(batchSize=128, learningRate=0.05, maxSteps=600)
    del doc["spec"]["training"]["targetAccuracy"]
    doc["spec"]["parameterServers"]["shards"] = 2
    return doc
