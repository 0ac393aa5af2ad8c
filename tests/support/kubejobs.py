"""A DistBeliefJob driven on the real control plane as a user drives it (kubectl), the
conditions tests wait for, and the kubelet's part played where a flow needs running pods."""

from __future__ import annotations

import copy
import json
import time
from typing import Any, Callable

import yaml

from support.cluster import Api, ApiError, Kubectl
from support.examples import load_example
from support.waiting import eventually


def new_job(name: str, **spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(load_example("digits-mlp.yaml"))
    doc["metadata"]["name"] = name
    for key, value in spec.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
    return doc


def apply(kubectl: Kubectl, namespace: str, doc: dict[str, Any]) -> dict[str, Any]:
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    return kubectl.json("get", "dbj", doc["metadata"]["name"], "-n", namespace)


def patch_job(kubectl: Kubectl, namespace: str, name: str, patch: dict[str, Any]) -> None:
    kubectl("patch", "dbj", name, "-n", namespace, "--type", "merge", "-p", json.dumps(patch))


def phase_is(phase: str) -> Callable[[Any], bool]:
    return lambda job: job is not None and (job.get("status") or {}).get("phase") == phase


def condition(job: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in job["status"]["conditions"] if c["type"] == kind)


def condition_holds(kind: str) -> Callable[[Any], bool]:
    return lambda job: any(c["type"] == kind and c["status"] == "True"
                           for c in ((job or {}).get("status") or {}).get("conditions", []))


def replicas_are(count: int) -> Callable[[Any], bool]:
    return lambda obj: obj is not None and obj["spec"]["replicas"] == count


def controller_of(obj: dict[str, Any]) -> dict[str, Any]:
    (owner,) = [o for o in obj["metadata"].get("ownerReferences", []) if o.get("controller")]
    return owner


READY = [{"type": kind, "status": "True"} for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]


def kubelet_runs(api: Api, namespace: str, job: str, *, role: str | None = None,
                 container_status: dict[str, Any] | None = None) -> list[str]:
    """Write the status of the job's pods as a kubelet running them would (ready, or as
    container_status says): the pods' names."""
    selector = f"distbelief.io/job={job}" + (f",distbelief.io/role={role}" if role else "")
    names = []
    for pod in api.list("v1/pods", namespace, selector):
        container = pod["spec"]["containers"][0]["name"]
        status = {"name": container, "ready": True, "started": True, "restartCount": 0, "image": "x", "imageID": "",
                  "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}, **(container_status or {})}
        try:
            api.patch("v1/pods", namespace, pod["metadata"]["name"], {"status": {
                "phase": "Running", "conditions": READY if status["ready"] else READY[:2],
                "containerStatuses": [status]}}, subresource="status")
        except ApiError as exc:
            if exc.code != 404:  # gone meanwhile (a rollout, a scale-down): no kubelet runs it
                raise
            continue
        names.append(pod["metadata"]["name"])
    return names


def pods_of(api: Api, namespace: str, job: str, count: int, role: str) -> None:
    """Wait until the controllers made count pods of the job's role."""
    selector = f"distbelief.io/job={job},distbelief.io/role={role}"
    eventually(lambda: len(api.list("v1/pods", namespace, selector)) >= count, 45, interval=0.2,
               what=f"the controllers make {count} {role} pods of {job}")


def pending_reshard_pods(api: Api, namespace: str, job: str) -> list[dict[str, Any]]:
    """The job's reshard pods that have not ended (no kubelet runs them here)."""
    return [p for p in api.list("v1/pods", namespace, f"distbelief.io/job={job},distbelief.io/role=reshard")
            if p["status"].get("phase") not in ("Succeeded", "Failed") and not p["metadata"].get("deletionTimestamp")]


def reshard_pod_ends(api: Api, namespace: str, job: str, exit_code: int, message: str) -> str:
    """Play the kubelet of a reshard pod of the job that has not ended: it ran, and ended with
    exit_code and message (its termination message). The pod's name."""
    pod = eventually(lambda: next(iter(pending_reshard_pods(api, namespace, job)), None), 60, interval=0.2,
                     what=f"a reshard pod of {job}")
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "message": message,
                  "startedAt": now, "finishedAt": now}
    api.patch("v1/pods", namespace, pod["metadata"]["name"], {"status": {
        "phase": "Succeeded" if exit_code == 0 else "Failed",
        "containerStatuses": [{"name": "reshard", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
                               "state": {"terminated": terminated}}]}}, subresource="status")
    return str(pod["metadata"]["name"])


def restored_steps(kubectl: Kubectl, namespace: str, pod: str) -> list[int] | None:
    """The step of each checkpoint the pod's log says it restored; None before the first."""
    log = kubectl.run("logs", pod, "-n", namespace).stdout
    return [int(line.split("step=")[1].split()[0]) for line in log.splitlines() if "event=restored" in line] or None
