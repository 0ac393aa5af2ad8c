"""Placement on a real control plane: a job lands on a tainted, labelled node only with its
templates' toleration and node selector (the real kube-scheduler decides), and trains there
(tools/local-node runs the pods)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from support.cluster import Kubectl
from support.localnode import (LocalNode, apply, chart, example, finished, get,  # noqa: F401 (fixtures)
                               local_node, operator)
from support.waiting import eventually

TAINT_KEY = "example.com/dedicated"


@pytest.fixture
def tainted_node(kubectl: Kubectl, local_node: LocalNode) -> Any:
    """The node tainted NoSchedule and labelled with a pool of its own; both removed after."""
    pool = f"pool-{uuid.uuid4().hex[:6]}"
    kubectl("taint", "node", local_node.name, f"{TAINT_KEY}=training:NoSchedule")
    kubectl("label", "node", local_node.name, f"example.com/pool={pool}")
    try:
        yield pool
    finally:
        kubectl("taint", "node", local_node.name, f"{TAINT_KEY}-", check=False)
        kubectl("label", "node", local_node.name, "example.com/pool-", check=False)


def placed(pool: str) -> dict[str, Any]:
    return {"spec": {"nodeSelector": {"example.com/pool": pool},
                     "tolerations": [{"key": TAINT_KEY, "operator": "Equal", "value": "training",
                                      "effect": "NoSchedule"}],
                     "priorityClassName": "system-cluster-critical"}}


def pod_count(job: dict[str, Any]) -> int:
    return job["spec"]["parameterServers"]["shards"] + job["spec"]["workers"]["replicas"]


def job_pods(kubectl: Kubectl, namespace: str, name: str) -> list[dict[str, Any]]:
    return get(kubectl, "pods", "-n", namespace, "-l", f"distbelief.io/job={name}")["items"]


def unschedulable(pod: dict[str, Any]) -> str | None:
    for condition in pod["status"].get("conditions") or []:
        if condition["type"] == "PodScheduled" and condition["status"] == "False":
            return condition.get("message") or condition.get("reason")
    return None


@pytest.mark.slow
def test_a_job_lands_on_a_tainted_node_only_with_its_templates_toleration_and_selector(
        kubectl: Kubectl, local_node: LocalNode, namespace: str, operator: Path, tainted_node: str) -> None:
    refused = example("digits-mlp.yaml", training__maxSteps=300)
    refused["metadata"]["name"] = "unplaced"
    apply(kubectl, namespace, refused)
    seen: list[Any] = []

    def refused_for_the_taint() -> bool:
        seen[:] = [unschedulable(p) for p in job_pods(kubectl, namespace, "unplaced")]
        return len(seen) == pod_count(refused) and all("untolerated taint" in (m or "") for m in seen)
    try:
        eventually(refused_for_the_taint, 60, what="the untolerating job's pods unschedulable for the taint")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {seen}") from None
    kubectl("delete", "dbj", "unplaced", "-n", namespace)

    job = example("digits-mlp.yaml", training__maxSteps=300, imagePullSecrets=[{"name": "registry"}],
                  parameterServers__template=placed(tainted_node), workers__template=placed(tainted_node))
    since = time.monotonic()
    apply(kubectl, namespace, job)
    pods = eventually(lambda: (found := job_pods(kubectl, namespace, "digits")) and len(found) == pod_count(job)
                      and all(p["spec"].get("nodeName") for p in found) and found, 60, what="the job's pods bound")
    for pod in pods:
        assert pod["spec"]["nodeName"] == local_node.name
        assert pod["spec"]["imagePullSecrets"] == [{"name": "registry"}]
        assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    status = finished(kubectl, namespace, "digits", operator, since)
    assert status["phase"] == "Succeeded", status
