#!/usr/bin/env python
"""Sparse jobs on click data shaped like real logs: held-out AUC by setting, against
one-hot logistic regression and the planted model.

    python benchmarks/heavy_tail_bench.py [--json benchmarks/results.json] [--settings defaults,no-wide]

The data: SOURCE, 12 fields of Zipf(1.15) ids over 10M ids, 3 % missing, 300,000
examples (240,000 to train, about 560k distinct (field, id) pairs), labels from a planted
logistic model with a weight per (field, id). Each setting is one job in local mode with
the spec's defaults but for the data and the setting's own fields (SETTINGS); its figures
are the final and the best held-out AUC the chief measured (on the first
spec.data.maxEvalExamples held-out examples) and its examples/s.

References on the same split and the same held-out examples: scikit-learn's
LogisticRegression on one-hot ids at each C of LR_C (the best is the reference a job has
to come within 0.01 of), and the planted model's own logits (what no model can beat).

Figures go into --json under "heavy_tail". A job with the defaults takes one to two
minutes on two cores, the 4-shard, 2-replica ones about five.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from figures import save_group

from distbelief.operator.local import local, report
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import jobspec
from distbelief.runtime.model import data, models

SOURCE = "synthetic-ctr:fields=12,ids=10000000,samples=300000,zipf=1.15,missing=0.03"
LR_C = (0.25, 0.5, 1.0)
NONE = {"wide": False, "l2": 0, "wideL2": 0, "embedAfter": 1}  # the embedding model without its three pieces
# A larger job: 4 shards and 2 replicas, 8-value rows, an MLP [32], batches of 256, 6,000 steps.
WIDER = {"model": {"hiddenLayers": [32]}, "training": {"batchSize": 256, "maxSteps": 6000, "learningRate": 0.05},
         "parameterServers": {"shards": 4}, "workers": {"replicas": 2}}
# (name, what it changes, spec.model.embeddings, the rest of the spec that differs from the defaults)
SETTINGS: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("defaults", "the defaults (wide part, l2 1e-3, wideL2 3e-5, embedAfter 5)", {}, {}),
    ("no-wide", "wide: false", {"wide": False}, {}),
    ("no-row-l2", "l2: 0, wideL2: 0", {"l2": 0, "wideL2": 0}, {}),
    ("embed-after-1", "embedAfter: 1", {"embedAfter": 1}, {}),
    ("none", "none of them: wide false, l2 0, wideL2 0, embedAfter 1", NONE, {}),
    ("defaults-lr1", "learningRate: 1.0", {}, {"training": {"learningRate": 1.0}}),
    ("4x2-defaults", "4 shards, 2 replicas, dim 8, [32], batch 256, 6,000 steps, rate 0.05", {"dim": 8}, WIDER),
    ("4x2-none", "the same, none of the three pieces", {"dim": 8, **NONE}, WIDER),
]


def job_doc(name: str, embeddings: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    job_spec = {"model": {**rest.get("model", {}), "embeddings": embeddings}, "data": {"source": SOURCE},
                **{key: value for key, value in rest.items() if key != "model"}}
    return {"apiVersion": "distbelief.io/v1alpha1", "kind": "DistBeliefJob", "metadata": {"name": f"heavy-{name}"},
            "spec": job_spec}


def run_setting(name: str, embeddings: dict[str, Any], rest: dict[str, Any], output: Path) -> dict[str, Any]:
    started = time.monotonic()
    code = local.LocalRun(DistBeliefJob.validated(job_doc(name, embeddings, rest)), str(output)).run(progress=False)
    summary = json.loads((output / report.REPORT_FILE).read_text())
    held_out = summary.get("heldOut") or {}
    return {"exitCode": code, "phase": summary.get("phase"), "auc": summary.get("auc"), "best_auc": held_out.get("best"),
            "best_step": held_out.get("bestStep"), "steps": summary.get("globalStep"),
            "examples_per_s": summary.get("examplesPerSecond"), "degraded": (summary.get("degraded") or {}).get("reason"),
            "seconds": round(time.monotonic() - started, 1)}


def references(held_out: int) -> dict[str, Any]:
    """Logistic regression at each C and the planted model, on the jobs' split and held-out examples."""
    from scipy import sparse as sp
    from sklearn.linear_model import LogisticRegression

    ids, y, logits = data.synthetic_ctr(SOURCE.split(":", 1)[1])
    split = data.split(np.zeros((len(y), 0), np.float32), y, ids=ids, test_fraction=jobspec.Data.test_fraction,
                       seed=jobspec.Data.seed)
    planted = data.split(logits[:, None].astype(np.float32), y, test_fraction=jobspec.Data.test_fraction,
                         seed=jobspec.Data.seed)
    assert split.ids_train is not None and split.ids_test is not None
    columns = one_hot_columns(split.ids_train)
    train, test = one_hot(split.ids_train, columns, sp), one_hot(split.ids_test[:held_out], columns, sp)
    y_test = split.y_test[:held_out]
    lr = {}
    for c in LR_C:
        fitted = LogisticRegression(C=c, max_iter=1000).fit(train, split.y_train)
        lr[str(c)] = models.auc(fitted.decision_function(test), y_test)
    return {"logistic_regression": lr, "logistic_regression_best": max(lr.values()),
            "planted": models.auc(planted.x_test[:held_out, 0], y_test),
            "distinct_train_ids": int(sum(v.size for v in columns)), "held_out_examples": int(y_test.size)}


def one_hot_columns(ids: np.ndarray) -> list[np.ndarray]:
    """Each field's ids seen in training, sorted: one column each."""
    return [np.unique(ids[:, f][ids[:, f] >= 0]) for f in range(ids.shape[1])]


def one_hot(ids: np.ndarray, columns: list[np.ndarray], sp: Any) -> Any:
    """The one-hot matrix of ids (an id unseen in training, or missing, sets no column)."""
    offsets = np.concatenate([[0], np.cumsum([c.size for c in columns])])
    rows, cols = [], []
    for f, seen in enumerate(columns):
        at = np.minimum(np.searchsorted(seen, ids[:, f]), seen.size - 1)
        known = (ids[:, f] >= 0) & (seen[at] == ids[:, f])
        rows.append(np.flatnonzero(known))
        cols.append(at[known] + offsets[f])
    r, c = np.concatenate(rows), np.concatenate(cols)
    return sp.csr_matrix((np.ones(r.size), (r, c)), shape=(len(ids), int(offsets[-1])))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--settings", default=",".join(s[0] for s in SETTINGS), help="names of SETTINGS to run")
    args = p.parse_args()
    wanted = args.settings.split(",")
    unknown = set(wanted) - {s[0] for s in SETTINGS}
    if unknown:
        p.error(f"unknown settings {sorted(unknown)}; known: {[s[0] for s in SETTINGS]}")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, changes, embeddings, rest in SETTINGS:
            if name in wanted:
                runs[name] = {"changes": changes, **run_setting(name, embeddings, rest, Path(tmp) / name)}
                print(name, json.dumps(runs[name]), flush=True)
    results = {"source": SOURCE, "runs": runs, **references(jobspec.Data.max_eval_examples)}
    if "defaults" in runs and runs["defaults"]["auc"] is not None:
        results["defaults_gap_to_lr"] = results["logistic_regression_best"] - runs["defaults"]["auc"]
    print(json.dumps(results, indent=2))
    save_group(results, "heavy_tail", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
