"""The autoscaler the operator renders, end to end on real nodes: metrics-server reads the
replicas' CPU from the kubelets, the controller-manager's HPA controller scales the job
through its /scale subresource, the operator follows (the Deployment, status.workers, a
WorkersScaled Event per change), new replicas join the training, and replicas that leave
end cleanly on SIGTERM while training goes on.

A training replica keeps its CPU busy whatever its number, so its load does not fall by
itself: the scale-down is driven by a higher utilisation target, as a user would set one.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from support import nodejobs, nodes
from support.cluster import Kubectl, unavailable
from support.nodes import NodeCluster, kubectl_binary
from support.paths import EXAMPLES
from support.waiting import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
NAME = "elastic"
# Generous bounds for a shared 2-core machine (never asserted on as times): metrics-server
# scrapes every 15 s, the HPA controller decides every 15 s.
SCALE_SECONDS = 600


def elastic_job() -> dict[str, Any]:
    """The digits example, one replica of 100m CPU requested, autoscaled 1..3 at 50 % of it,
    scaling without the 5-minute stabilisation of a scale-down, and training until deleted."""
    doc = copy.deepcopy(yaml.safe_load((EXAMPLES / "digits-mlp.yaml").read_text()))
    doc["metadata"]["name"] = NAME
    doc["spec"]["training"].update(maxSteps=10**9, maxDuration="30m")
    workers = doc["spec"]["workers"]
    workers["replicas"] = 1
    workers["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    fast = {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 2, "periodSeconds": 15}]}
    workers["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3, "metrics": [cpu_target(50)],
                              "behavior": {"scaleUp": fast, "scaleDown": {**fast, "stabilizationWindowSeconds": 15}}}
    return doc


def cpu_target(percent: int) -> dict[str, Any]:
    return {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization",
                                                                        "averageUtilization": percent}}}


@pytest.fixture
def follow_logs(tmp_path: Path, node_cluster: NodeCluster) -> Iterator[Callable[[str, str], Path]]:
    """Stream a pod's log to a file until the pod is gone (its lines outlive the pod)."""
    streams: list[subprocess.Popen[bytes]] = []

    def follow(namespace: str, pod: str) -> Path:
        path = tmp_path / f"{pod}.log"
        with open(path, "wb") as out:
            streams.append(subprocess.Popen([kubectl_binary(), "logs", "-f", "-n", namespace, pod], stdout=out,
                                            stderr=subprocess.STDOUT, env=node_cluster.env()))
        return path

    yield follow
    for stream in streams:
        stream.terminate()
        stream.wait(timeout=30)


def workers(kubectl: Kubectl, namespace: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in nodejobs.job_pods(kubectl, namespace, NAME)
                  if "-worker-" in p["metadata"]["name"] and not p["metadata"].get("deletionTimestamp")
                  and p.get("status", {}).get("phase") == "Running")


def scaled_to(kubectl: Kubectl, namespace: str, replicas: int, release: str, what: str) -> dict[str, Any]:
    """The job's status once the autoscaler brought it to `replicas` ready replicas."""
    def reached() -> dict[str, Any] | None:
        status = nodejobs.status_of(kubectl, namespace, NAME)
        ready = (status.get("workers") or {}).get("ready")
        return status if ready == replicas and len(workers(kubectl, namespace)) == replicas else None
    try:
        return eventually(reached, SCALE_SECONDS, interval=2, what=what)
    except AssertionError as exc:
        hpa = kubectl("describe", "hpa", "-n", namespace, check=False)
        raise AssertionError(f"{exc}\n{hpa}\n{nodejobs.diagnostics(kubectl, namespace, release)}") from None


def test_cpu_load_scales_the_replicas_up_through_the_hpa_and_a_higher_target_scales_them_down(
        kubectl: Kubectl, release: str, namespace: str, node_cluster: NodeCluster,
        follow_logs: Callable[[str, str], Path]) -> None:
    if not node_cluster.has("metrics-server"):
        unavailable(f"no metrics-server: {node_cluster.metrics_note}")
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(elastic_job()))
    with nodes.Timed("autoscaling: 1 -> 3 replicas under CPU load"):
        up = scaled_to(kubectl, namespace, 3, release, "the autoscaler's scale-up to 3 replicas")
    assert up["phase"] == "Running", up
    logs = {pod: follow_logs(namespace, pod) for pod in workers(kubectl, namespace)}
    eventually(lambda: all("event=joined" in path.read_text() for path in logs.values()), 300, interval=2,
               what="every replica joined the training")
    step_up = nodejobs.status_of(kubectl, namespace, NAME).get("globalStep", 0)

    kubectl("patch", "dbj", NAME, "-n", namespace, "--type=merge", "-p", yaml.safe_dump(
        {"spec": {"workers": {"autoscaling": {"metrics": [cpu_target(100_000)]}}}}))
    with nodes.Timed("autoscaling: 3 -> 1 replica at a higher target"):
        down = scaled_to(kubectl, namespace, 1, release, "the autoscaler's scale-down to 1 replica")
    gone = [pod for pod in logs if pod not in workers(kubectl, namespace)]
    assert len(gone) == 2, (gone, workers(kubectl, namespace))
    for pod in gone:   # SIGTERM: the replica stops between steps and says so
        text = eventually(lambda pod=pod: "event=worker_exit" in logs[pod].read_text() and logs[pod].read_text(),
                          120, interval=1, what=f"{pod}'s exit line")
        assert "Traceback" not in text, text[-3000:]
    eventually(lambda: nodejobs.status_of(kubectl, namespace, NAME).get("globalStep", 0) > down.get("globalStep", 0)
               > step_up, 180, interval=2, what="training going on after the scale-down")

    events = sorted((e for e in kubectl.json("get", "events", "-n", namespace)["items"]
                     if e["involvedObject"].get("name") == NAME and e["reason"] == "WorkersScaled"),
                    key=lambda e: e.get("firstTimestamp") or e["metadata"]["creationTimestamp"])
    changes = [e["message"].removeprefix("model replicas ") for e in events]
    assert changes and changes[0].startswith("1 -> ") and changes[-1].endswith(" -> 1"), changes
    # The autoscaler's own status catches up at its next sync (every 15 s).
    hpa = eventually(lambda: (h := kubectl.json("get", "hpa", f"{NAME}-worker", "-n", namespace))["status"].get(
        "currentReplicas") == 1 and h, 120, interval=2, what="the autoscaler's status at 1 replica")
    assert hpa["status"]["currentMetrics"], hpa["status"]
    kubectl("delete", "dbj", NAME, "-n", namespace, "--wait=false")
