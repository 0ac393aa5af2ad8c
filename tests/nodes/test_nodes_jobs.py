"""The examples, applied as a user applies them, train to Succeeded on the real nodes: the
chart's operator (in-cluster, on the pod network) renders them, the StatefulSet and
Deployment controllers make the pods, the scheduler spreads them over the nodes, kubelets
run them from the runtime image, the shards' checkpoints go to claimed volumes, replicas
reach shards on other nodes by their DNS names, and the operator reads the chief's
metrics into the status."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from support import nodejobs
from support.cluster import Kubectl
from support.paths import EXAMPLES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
# A job's whole run, from kubectl apply: generous (a shared machine); never asserted on.
JOB_SECONDS = 1500


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def assert_trained(kubectl: Kubectl, namespace: str, job: dict[str, Any], status: dict[str, Any],
                   placements: dict[str, str]) -> None:
    assert status["phase"] == "Succeeded", status
    assert status["globalStep"] >= job["spec"]["training"]["maxSteps"], status
    assert len(set(placements.values())) >= 2, f"every pod on one node: {placements}"
    shards = job["spec"]["parameterServers"]
    claims = nodejobs.claims(kubectl, namespace)
    assert len(claims) == shards["shards"] * (1 + shards.get("backups", 0)), claims
    assert {(c["status"]["phase"], c["spec"]["storageClassName"]) for c in claims} == {("Bound", "node-hostpath")}


def test_the_digits_example_trains_to_succeeded_on_pods_spread_over_the_nodes(
        kubectl: Kubectl, release: str, namespace: str) -> None:
    job = example("digits-mlp.yaml")
    status, placements = nodejobs.train(kubectl, namespace, job, timeout=JOB_SECONDS, operator_namespace=release)
    assert_trained(kubectl, namespace, job, status, placements)
    nodejobs.assert_learned(kubectl, namespace, "digits", status, "accuracy", 0.9, release)
    assert {"digits-ps-0", "digits-ps-1"} <= placements.keys(), placements
    assert any(pod.startswith("digits-worker-") for pod in placements), placements


def test_the_partitioned_example_trains_to_succeeded_with_stages_on_different_nodes(
        kubectl: Kubectl, release: str, namespace: str) -> None:
    job = example("digits-partitioned.yaml")
    status, placements = nodejobs.train(kubectl, namespace, job, timeout=JOB_SECONDS, operator_namespace=release)
    assert_trained(kubectl, namespace, job, status, placements)
    nodejobs.assert_learned(kubectl, namespace, job["metadata"]["name"], status, "accuracy", 0.8, release)
    # Both stages ran, their pods exchanging activations and gradients across the pod network.
    stages = {pod: node for pod, node in placements.items() if "-worker-p" in pod}
    assert {p.split("-worker-")[1][:2] for p in stages} == {"p0", "p1"}, placements


def test_the_sparse_example_trains_to_succeeded_and_beats_chance_on_auc(
        kubectl: Kubectl, release: str, namespace: str) -> None:
    job = example("ctr-sparse.yaml")
    status, placements = nodejobs.train(kubectl, namespace, job, timeout=JOB_SECONDS, operator_namespace=release)
    assert_trained(kubectl, namespace, job, status, placements)
    nodejobs.assert_learned(kubectl, namespace, job["metadata"]["name"], status, "auc", 0.72, release)   # chance 0.5; as locally
