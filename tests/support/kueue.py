"""Kueue's side, played by the tests: the Workload and ResourceFlavor types (kueue.x-k8s.io/
v1beta1, minimal schemas of our own, not Kueue's) and what Kueue writes to a Workload's
status when it admits, evicts and admits it again."""

from __future__ import annotations

import datetime
import json
from typing import Any

from support.cluster import Kubectl

GROUP, VERSION = "kueue.x-k8s.io", "v1beta1"
QUEUE_LABEL = f"{GROUP}/queue-name"


def _crd(plural: str, kind: str, scope: str) -> dict[str, Any]:
    opaque = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{GROUP}"},
            "spec": {"group": GROUP, "scope": scope,
                     "names": {"plural": plural, "singular": kind.lower(), "kind": kind, "listKind": f"{kind}List"},
                     "versions": [{"name": VERSION, "served": True, "storage": True,
                                   "subresources": {"status": {}},
                                   "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                                       "spec": opaque, "status": opaque}}}}]}}


def install_crds(kubectl: Kubectl) -> None:
    for plural, kind, scope in (("workloads", "Workload", "Namespaced"),
                                ("resourceflavors", "ResourceFlavor", "Cluster")):
        kubectl("apply", "-f", "-", input=json.dumps(_crd(plural, kind, scope)))
        kubectl("wait", "--for=condition=Established", f"crd/{plural}.{GROUP}", "--timeout=60s")


def flavor(kubectl: Kubectl, name: str, node_labels: dict[str, str], tolerations: list[dict[str, Any]]) -> None:
    doc = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceFlavor", "metadata": {"name": name},
           "spec": {"nodeLabels": node_labels, "tolerations": tolerations}}
    kubectl("apply", "-f", "-", input=json.dumps(doc))


def workload(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any] | None:
    done = kubectl.run("get", f"workloads.{GROUP}", name, "-n", namespace, "-o", "json")
    return json.loads(done.stdout) if done.returncode == 0 else None


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def _condition(kind: str, status: str, reason: str) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": kind, "status": status, "reason": reason, "message": reason, "lastTransitionTime": now}


def _write_status(kubectl: Kubectl, namespace: str, name: str, status: dict[str, Any]) -> None:
    kubectl("patch", f"workloads.{GROUP}", name, "-n", namespace, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": status}))


def admit(kubectl: Kubectl, namespace: str, name: str, flavor_name: str) -> None:
    """What Kueue's scheduler writes: the admission (every podSet on flavor_name), QuotaReserved
    and Admitted, and an earlier Evicted condition reset."""
    current = workload(kubectl, namespace, name) or {}
    assignments = [{"name": s["name"], "count": s["count"], "flavors": {"cpu": flavor_name}}
                   for s in current["spec"]["podSets"]]
    conditions = [_condition("QuotaReserved", "True", "QuotaReserved"), _condition("Admitted", "True", "Admitted")]
    if condition(current, "Evicted"):
        conditions.append(_condition("Evicted", "False", "QuotaReserved"))
    _write_status(kubectl, namespace, name, {"admission": {"clusterQueue": "cluster-queue",
                                                           "podSetAssignments": assignments},
                                             "conditions": conditions})


def evict(kubectl: Kubectl, namespace: str, name: str) -> None:
    """What Kueue writes when a workload of higher priority preempts this one."""
    current = workload(kubectl, namespace, name) or {}
    kept = [c for c in current["status"]["conditions"] if c["type"] != "Evicted"]
    _write_status(kubectl, namespace, name, {"conditions": [*kept, _condition("Evicted", "True", "Preempted")]})
