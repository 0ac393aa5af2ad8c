"""The autoscaler the operator renders, end to end on real nodes: metrics-server reads the
replicas' CPU from the kubelets, the controller-manager's HPA controller scales the job
through its /scale subresource, the operator follows (the Deployment, status.workers, a
WorkersScaled Event per change), new replicas join the training, and replicas that leave
end cleanly on SIGTERM while training goes on.

A training replica keeps its CPU busy whatever its number, so its load does not fall by
itself: the scale-down is driven by a higher utilisation target, as a user would set one.

The job's own signal goes the same way: the examples each replica trains per second, from
Prometheus through prometheus-adapter (support/custommetrics.py) as a Pods metric.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from support import custommetrics, nodejobs, nodes
from support.cluster import Kubectl, unavailable
from support.nodes import NodeCluster, kubectl_binary
from support.paths import EXAMPLES
from support.waiting import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
NAME = "elastic"
SIGNAL = "signal"
EXAMPLES_METRIC = "distbelief_worker_examples_per_second"   # charts/prometheus-adapter-values.yaml
# Scaling without the 5-minute stabilisation of a scale-down, by up to 2 pods each 15 s.
_STEP = {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 2, "periodSeconds": 15}]}
FAST = {"scaleUp": _STEP, "scaleDown": {**_STEP, "stabilizationWindowSeconds": 15}}
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
    workers["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3, "metrics": [cpu_target(50)], "behavior": FAST}
    return doc


def signal_job(target: str) -> dict[str, Any]:
    """examples/digits-autoscaled.yaml, which scales on the examples each replica trains per
    second: 1..3 replicas at `target`, as fast as elastic_job, training until deleted."""
    doc = yaml.safe_load((EXAMPLES / "digits-autoscaled.yaml").read_text())
    doc["metadata"]["name"] = SIGNAL
    doc["spec"]["training"].update(maxSteps=10**9, maxDuration="30m")
    autoscaling = doc["spec"]["workers"]["autoscaling"]
    autoscaling.update(maxReplicas=3, behavior=FAST)
    autoscaling["metrics"] = [examples_target(target)]
    return doc


def examples_target(per_second: str) -> dict[str, Any]:
    return {"type": "Pods", "pods": {"metric": {"name": EXAMPLES_METRIC},
                                     "target": {"type": "AverageValue", "averageValue": per_second}}}


def quantity(text: str) -> float:
    """A Kubernetes quantity as the custom metrics API writes rates: 2345, 2345500m, 2k."""
    scale = {"m": 1e-3, "k": 1e3, "M": 1e6}
    return float(text[:-1]) * scale[text[-1]] if text[-1] in scale else float(text)


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


def workers(kubectl: Kubectl, namespace: str, job: str = NAME) -> list[str]:
    return sorted(p["metadata"]["name"] for p in nodejobs.job_pods(kubectl, namespace, job)
                  if "-worker-" in p["metadata"]["name"] and not p["metadata"].get("deletionTimestamp")
                  and p.get("status", {}).get("phase") == "Running")


def scaled_to(kubectl: Kubectl, namespace: str, replicas: int, release: str, what: str,
              job: str = NAME) -> dict[str, Any]:
    """The job's status once the autoscaler brought it to `replicas` ready replicas."""
    def reached() -> dict[str, Any] | None:
        status = nodejobs.status_of(kubectl, namespace, job)
        ready = (status.get("workers") or {}).get("ready")
        return status if ready == replicas and len(workers(kubectl, namespace, job)) == replicas else None
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


def per_replica_rates(kubectl: Kubectl, namespace: str) -> dict[str, float] | None:
    """What the custom metrics API serves for the job's replicas: pod -> examples per second."""
    path = f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{namespace}/pods/*/{EXAMPLES_METRIC}"
    done = kubectl.run("get", "--raw", path)
    if done.returncode != 0:
        return None
    rates = {i["describedObject"]["name"]: quantity(i["value"]) for i in json.loads(done.stdout)["items"]
             if i["describedObject"]["name"].startswith(f"{SIGNAL}-worker-")}
    return rates if rates and all(rates.values()) else None


def test_the_examples_each_replica_trains_scale_the_replicas_through_prometheus_adapter(
        kubectl: Kubectl, release: str, namespace: str, node_cluster: NodeCluster) -> None:
    """The job's own signal, as a user autoscales on it: Prometheus scrapes the replicas,
    prometheus-adapter (built from its module) serves their rate by the chart values we ship,
    and the HPA controller scales the job through its /scale: up while each replica trains
    more than the target, down once the target is more than they train."""
    with custommetrics.serving(node_cluster):
        kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(signal_job("100")))
        # One replica trains far more than 100 examples/s; the first rates served can be lower,
        # the rate over a minute that began before the replica's first step (0.54 seen).
        eventually(lambda: (rates := per_replica_rates(kubectl, namespace)) and min(rates.values()) > 100,
                   SCALE_SECONDS, interval=2, what=f"{EXAMPLES_METRIC} served for the replica, above 100")
        with nodes.Timed("autoscaling: 1 -> 3 replicas on examples per second"):
            scaled_to(kubectl, namespace, 3, release, "the scale-up to 3 replicas on the custom metric", job=SIGNAL)
        hpa = kubectl.json("get", "hpa", f"{SIGNAL}-worker", "-n", namespace)
        (current,) = hpa["status"]["currentMetrics"]
        assert current["type"] == "Pods" and current["pods"]["metric"]["name"] == EXAMPLES_METRIC, current
        assert quantity(current["pods"]["current"]["averageValue"]) > 100, current

        kubectl("patch", "dbj", SIGNAL, "-n", namespace, "--type=merge", "-p", yaml.safe_dump(
            {"spec": {"workers": {"autoscaling": {"metrics": [examples_target("10000000")]}}}}))
        with nodes.Timed("autoscaling: 3 -> 1 replica, each training less than the target"):
            scaled_to(kubectl, namespace, 1, release, "the scale-down to 1 replica on the custom metric", job=SIGNAL)
        kubectl("delete", "dbj", SIGNAL, "-n", namespace, "--wait=true", timeout=300)
