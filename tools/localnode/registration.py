"""The Node object, its Lease and its heartbeat, as a kubelet keeps them.

register() creates the Node (or takes over an existing one of the name) with its labels
(kubernetes.io/hostname, os, arch), capacity and allocatable (cpu, memory, pods: this
machine's unless overridden), its address (InternalIP 127.0.0.1), nodeInfo, the agent's
endpoint (endpoint.py) as the kubelet's, and a Ready condition. heartbeat() renews the
Lease in kube-node-lease (what the node lifecycle controller watches) and writes the
conditions again with a fresh lastHeartbeatTime; the agent calls it every few seconds.
A Node deleted meanwhile is registered again, as a kubelet does.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import platform
from typing import Any, Mapping

from localnode import api as node_api
from localnode.addresses import HOST_IP

log = logging.getLogger(__name__)

LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40
VERSION = "v1.36.2-local-node"
DEFAULT_PODS = 110
Manifest = dict[str, Any]


def machine_capacity(cpu: str | None = None, memory: str | None = None, pods: int | None = None) -> dict[str, str]:
    """This machine's CPUs (those this process may use), memory and a pod count; each overridable."""
    if memory is None:
        with open("/proc/meminfo") as f:
            total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        memory = f"{total_kib}Ki"
    return {"cpu": cpu or str(len(os.sched_getaffinity(0))), "memory": memory, "pods": str(pods or DEFAULT_PODS)}


def micro_time(now: datetime.datetime | None = None) -> str:
    return (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass
class Registration:
    api: node_api.Api
    name: str
    capacity: Mapping[str, str]
    port: int = 0                 # the agent's endpoint (endpoint.py), 0 if none
    uid: str = ""
    ready_since: str = ""

    def register(self) -> None:
        node = self.api.create_path(node_api.path("v1", "nodes"), self._node())
        if node is None:  # there already: ours now
            node = self.api.patch_path(node_api.path("v1", "nodes", name=self.name),
                                       {"metadata": {"labels": self._labels()}, "spec": {"unschedulable": False}})
        self.uid = (node or {}).get("metadata", {}).get("uid", "")
        self.ready_since = _now()
        self._write_status()
        self._renew_lease()
        log.info("event=node_registered node=%s capacity=%s", self.name, dict(self.capacity))

    def heartbeat(self) -> None:
        """Renew the Lease and the Ready condition's heartbeat (register again if the Node went)."""
        if self.api.get_path(node_api.path("v1", "nodes", name=self.name)) is None:
            log.warning("event=node_gone node=%s action=register", self.name)
            self.register()
        self._renew_lease()
        self._write_status()

    def stopped(self) -> None:
        """Say the node no longer runs pods (the agent is stopping)."""
        self._write_status(ready=False)

    def _labels(self) -> dict[str, str]:
        arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
        return {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": arch,
                "node.kubernetes.io/local-node": "true"}

    def _node(self) -> Manifest:
        return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name, "labels": self._labels()},
                "spec": {}, "status": self._status(ready=True)}

    def _status(self, *, ready: bool) -> Manifest:
        now = _now()
        pressure = [{"type": kind, "status": "False", "reason": f"KubeletHas{reason}", "message": message,
                     "lastHeartbeatTime": now, "lastTransitionTime": self.ready_since or now}
                    for kind, reason, message in (("MemoryPressure", "SufficientMemory", "memory available"),
                                                  ("DiskPressure", "NoDiskPressure", "no disk pressure"),
                                                  ("PIDPressure", "SufficientPID", "PIDs available"))]
        readiness = {"type": "Ready", "status": "True" if ready else "False",
                     "reason": "KubeletReady" if ready else "KubeletNotReady",
                     "message": "local-node is running pods" if ready else "local-node stopped",
                     "lastHeartbeatTime": now, "lastTransitionTime": self.ready_since or now if ready else now}
        return {"capacity": dict(self.capacity), "allocatable": dict(self.capacity),
                # No Hostname address: the API server would dial it first, and nothing resolves it.
                "addresses": [{"type": "InternalIP", "address": HOST_IP}],
                "conditions": [*pressure, readiness],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.port}},
                "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": platform.release(),
                             "osImage": platform.platform(), "containerRuntimeVersion": "local-node://processes",
                             "kubeletVersion": VERSION, "kubeProxyVersion": "", "operatingSystem": "linux",
                             "architecture": self._labels()["kubernetes.io/arch"]}}

    def _write_status(self, *, ready: bool = True) -> None:
        self.api.patch_path(node_api.path("v1", "nodes", name=self.name, subresource="status"),
                            {"status": self._status(ready=ready)})

    def _renew_lease(self) -> None:
        where = node_api.path("coordination.k8s.io/v1", "leases", LEASE_NAMESPACE, self.name)
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": micro_time()}
        if self.api.patch_path(where, {"spec": spec}) is None:
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self.uid}
            lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                     "metadata": {"name": self.name, "namespace": LEASE_NAMESPACE,
                                  "ownerReferences": [owner] if self.uid else []}, "spec": spec}
            self.api.create_path(node_api.path("coordination.k8s.io/v1", "leases", LEASE_NAMESPACE), lease)
