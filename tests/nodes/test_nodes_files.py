"""A job reading Parquet files from a claimed volume trains on the real nodes. A pod of the
runtime image writes the files onto a claim of the node-hostpath StorageClass (the tier's
volumes: hostPath folders every node sees); the job names the claim in spec.data.volume,
its pods on several nodes mount it read-only, the chief's dispenser hands out row groups,
and the replicas read them from /data."""

from __future__ import annotations

import json
from typing import Any

import pytest

from support import nodejobs, nodes
from support.cluster import Kubectl
from support.waiting import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
JOB_SECONDS = 1500
CLAIM = "training-files"
# Run in the writer pod (python -c): four training files of four row groups each and one
# held-out file, 16 features and 4 classes that a small MLP separates (the label is the
# argmax of a fixed linear map of the features).
WRITER = """
import os
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
rng = np.random.default_rng(7)
weights = rng.normal(size=(16, 4))
def table(rows):
    x = rng.normal(size=(rows, 16)).astype("float32")
    columns = {f"f{i}": x[:, i] for i in range(16)}
    columns["y"] = np.argmax(x @ weights, axis=1).astype("int64")
    return pa.table(columns)
os.makedirs("/data/blobs", exist_ok=True)
for i in range(4):
    pq.write_table(table(2000), f"/data/blobs/train-{i}.parquet", row_group_size=500)
pq.write_table(table(1000), "/data/blobs/eval-0.parquet")
print(sorted(os.listdir("/data/blobs")))
"""


def claim() -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}


def writer() -> dict[str, Any]:
    security = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]}}
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "write-files"},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "write", "image": nodes.RUNTIME_IMAGE, "imagePullPolicy": "IfNotPresent",
                            "command": ["python", "-c", WRITER], "securityContext": security,
                            "volumeMounts": [{"name": "files", "mountPath": "/data"}]}],
            "volumes": [{"name": "files", "persistentVolumeClaim": {"claimName": CLAIM}}],
        },
    }


def job() -> dict[str, Any]:
    resources = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    return {
        "apiVersion": "distbelief.io/v1alpha1", "kind": "DistBeliefJob", "metadata": {"name": "blobs"},
        "spec": {
            "model": {"type": "mlp", "hiddenLayers": [32], "activation": "relu"},
            "data": {"source": "parquet:/data/blobs/train-*.parquet", "test": "/data/blobs/eval-*.parquet",
                     "volume": CLAIM},
            "training": {"batchSize": 32, "learningRate": 0.05, "optimizer": "adagrad", "maxSteps": 3000,
                         "maxDuration": "10m", "evalEverySeconds": 0.5},
            "parameterServers": {"shards": 2, "resources": resources,
                                 "checkpoint": {"everySeconds": 10, "storage": {"size": "1Gi"}}},
            "workers": {"replicas": 2, "resources": resources},
            "runPolicy": {"backoffLimit": 3},
        },
    }


def test_a_job_reading_parquet_files_from_a_claimed_volume_trains_to_succeeded_across_nodes(
        kubectl: Kubectl, release: str, namespace: str) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(claim()))
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(writer()))

    def written() -> bool:
        phase = kubectl.json("get", "pod", "write-files", "-n", namespace)["status"].get("phase")
        assert phase != "Failed", kubectl("logs", "-n", namespace, "write-files", check=False)
        return phase == "Succeeded"

    eventually(written, timeout=300, interval=1, what="the writer pod to write the Parquet files")
    assert "train-3.parquet" in kubectl("logs", "-n", namespace, "write-files")

    status, placements = nodejobs.train(kubectl, namespace, job(), timeout=JOB_SECONDS, operator_namespace=release)
    assert status["phase"] == "Succeeded", status
    nodejobs.assert_learned(kubectl, namespace, "blobs", status, "accuracy", 0.85, release)   # 4 classes: chance 0.25
    # The replicas went through the files: a whole epoch is 16 row groups handed out and read.
    assert status["epoch"] >= 1, status
    assert len({node for pod, node in placements.items() if pod.startswith("blobs-")}) >= 2, placements
    (data,) = [c for c in nodejobs.claims(kubectl, namespace) if c["metadata"]["name"] == CLAIM]
    assert data["status"]["phase"] == "Bound", data
