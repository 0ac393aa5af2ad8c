"""status.json in a local run's output folder: the job as the operator would store it (spec
and the status compute_status gives, written at every poll of the run) and its pods (role,
metrics port, running, restarts, log file), so that `kubectl distbelief --local DIR` shows a
local run as it shows a job on a cluster, while it runs and after.

The run that writes it holds the folder's lock (outputdir.locked); once nothing holds it,
the run has ended, and report.json, written at its end, says how.
"""

from __future__ import annotations

import json
import os
from typing import Any

from distbelief.operator.local.localpods import LocalPod
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract

STATUS_FILE = "status.json"


def write(output: str, job: DistBeliefJob, pods: list[LocalPod]) -> None:
    """Replace status.json at once (a reader never sees half of it)."""
    document = {"job": job.manifest(), "pods": [_pod_entry(pod) for pod in pods]}
    path = os.path.join(output, STATUS_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(document, f)
    os.replace(path + ".tmp", path)


def _pod_entry(pod: LocalPod) -> dict[str, Any]:
    return {"name": pod.name, "role": pod.role, "workload": pod.workload, "running": pod.running,
            "restarts": pod.restarts, "metricsPort": pod.ports.get(contract.METRICS_PORT_NAME),
            "log": os.path.join("logs", os.path.basename(pod.log_path))}


def read(output: str) -> dict[str, Any] | None:
    """The folder's status.json ({"job": ..., "pods": [...]}), None when it has none."""
    try:
        with open(os.path.join(output, STATUS_FILE), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
