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
