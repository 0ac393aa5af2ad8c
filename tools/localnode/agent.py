"""The node agent's loops: the Node's heartbeat, the volume claims, and the pods bound here.

    every SYNC_SECONDS       list the pods bound to the Node; start new ones (pods.py), look
                             after each one's containers, write each status that changed; a pod
                             with a deletionTimestamp is stopped (SIGTERM, its grace period,
                             SIGKILL) and then deleted with grace period 0, as a kubelet does;
                             a pod gone from the API is stopped at once
    every heartbeat seconds  renew the Lease, refresh the Node's conditions (registration.py)
    every PROVISION_SECONDS  provision volumes for waiting claims, delete released ones

The memory watchdog of local mode looks at every container's process every 0.1 s. stop()
ends the loops; run() then stops every pod's processes (they would get SIGTERM anyway when
the agent dies: localpods arms the parent-death signal) and marks the Node not ready.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Callable

from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from distbelief.operator.local import localpods, podusage
from localnode import api as node_api, logs, probes
from localnode.addresses import PodNetwork, cluster_identity
from localnode.pods import NodeContext, NodePod
from localnode.provisioner import Provisioner
from localnode.endpoint import Endpoint
from localnode.registration import Registration

log = logging.getLogger(__name__)

SYNC_SECONDS = 0.5
PROVISION_SECONDS = 1.0
SHUTDOWN_GRACE_SECONDS = 10.0
FORCED_GRACE_SECONDS = 2.0   # for a pod deleted with grace period 0, as a kubelet's minimum
API_ERRORS = (ApiException, HTTPError, OSError)


@dataclasses.dataclass(frozen=True)
class Options:
    kubeconfig: str
    name: str
    root: str
    capacity: dict[str, str]
    heartbeat: float = 5.0
    port: int = 0                   # of the HTTP endpoint on 127.0.0.1; 0: any free one
    backoff_start: float = 1.0
    backoff_max: float = 30.0


class Agent:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.api = node_api.Api(node_api.client_from(options.kubeconfig))
        self.network = PodNetwork(cluster_identity(self.api))
        self.prober = probes.Prober()
        self.ctx = NodeContext(api=self.api, network=self.network, root=options.root, capacity=options.capacity,
                               prober=self.prober, backoff_start=options.backoff_start,
                               backoff_max=options.backoff_max)
        self.endpoint = Endpoint(self.network, self._find_log, options.root, port=options.port)
        self.registration = Registration(self.api, options.name, options.capacity, port=self.endpoint.port)
        self.provisioner = Provisioner(self.api, options.name, options.root)
        self.pods: dict[str, NodePod] = {}
        self.leaving: dict[str, threading.Thread] = {}
        self._stop = threading.Event()

    def stop(self, *_: object) -> None:
        self._stop.set()

    def run(self) -> None:
        os.makedirs(self.options.root, exist_ok=True)
        self.endpoint.start()
        self.registration.register()
        log.info("event=node_agent_started node=%s root=%s endpoint=http://127.0.0.1:%d cluster=%s",
                 self.options.name, self.options.root, self.endpoint.port, self.network.cluster)
        loops = [threading.Thread(target=self._every, args=(seconds, step), name=step.__name__, daemon=True)
                 for seconds, step in ((self.options.heartbeat, self.registration.heartbeat),
                                       (PROVISION_SECONDS, self.provisioner.sync))]
        for loop in loops:
            loop.start()
        with podusage.MemoryWatchdog(self._processes):
            self._every(SYNC_SECONDS, self.sync_pods)
            self._shut_down()
        for loop in loops:
            loop.join(timeout=5)

    def sync_pods(self) -> None:
        """One round over the pods bound here (in the main thread: the parent-death signal
        of a container's process follows the thread that started it)."""
        listed = self.api.list_path(node_api.path("v1", "pods"), fields={"spec.nodeName": self.options.name})
        for manifest in listed:
            _logged(lambda: self._sync_one(manifest), f"pod {manifest['metadata']['name']}")()  # noqa: B023 (called at once)
        seen = {manifest["metadata"]["uid"] for manifest in listed}
        for uid in set(self.pods) - seen:  # deleted from the API at once (grace period 0)
            self._leave(self.pods[uid], delete=False)
        for uid, thread in list(self.leaving.items()):
            if not thread.is_alive():
                del self.leaving[uid]
                self.pods.pop(uid, None)

    def _sync_one(self, manifest: node_api.Manifest) -> None:
        pod = self.pods.get(manifest["metadata"]["uid"])
        if pod is None:
            if _finished_elsewhere(manifest):  # ended before this agent started: nothing to run
                self._delete_if_deleting(manifest)
                return
            pod = self.pods[manifest["metadata"]["uid"]] = NodePod(manifest, self.ctx)
            log.info("event=pod_accepted pod=%s/%s ip=%s", pod.namespace, pod.name, pod.ip)
        pod.manifest = manifest
        if manifest["metadata"].get("deletionTimestamp"):
            self._leave(pod, delete=True)
            return
        pod.sync()
        self._write(pod)

    def _processes(self) -> list[localpods.LocalPod]:
        return [process for pod in list(self.pods.values()) for process in pod.processes]

    def _find_log(self, namespace: str, name: str, container: str) -> logs.LogSource | None:
        """The log of a container of a pod here, else of one that was (kept under root)."""
        for pod in list(self.pods.values()):
            run = next((r for r in pod.runs if r.spec["name"] == container and r.process), None)
            if (pod.namespace, pod.name) == (namespace, name) and run is not None:
                return logs.LogSource(run.process.log_path, lambda run=run: run.running)
        return logs.on_disk(self.options.root, namespace, name, container)

    def _write(self, pod: NodePod) -> None:
        try:
            pod.write_status()
        except API_ERRORS as exc:
            log.warning("event=pod_status_not_written pod=%s/%s error=%s", pod.namespace, pod.name, exc)

    def _leave(self, pod: NodePod, *, delete: bool) -> None:
        """Stop the pod's processes in a thread of their own; then delete it (grace period 0)."""
        if pod.uid in self.leaving:
            return
        grace = pod.grace_seconds if delete else FORCED_GRACE_SECONDS

        def leave() -> None:
            pod.stop(grace)
            if delete:
                self._write(pod)
                self.api.delete_path(node_api.path("v1", "pods", pod.namespace, pod.name), grace_seconds=0,
                                     uid=pod.uid)
            pod.remove_folder()
            log.info("event=pod_left pod=%s/%s deleted=%s", pod.namespace, pod.name, delete)

        self.leaving[pod.uid] = thread = threading.Thread(target=_logged(leave), name=f"leave-{pod.name}", daemon=True)
        thread.start()

    def _delete_if_deleting(self, manifest: node_api.Manifest) -> None:
        meta = manifest["metadata"]
        if meta.get("deletionTimestamp"):
            self.api.delete_path(node_api.path("v1", "pods", meta["namespace"], meta["name"]), grace_seconds=0,
                                 uid=meta["uid"])

    def _every(self, seconds: float, step: Callable[[], None]) -> None:
        """step every `seconds` until stop()."""
        while not self._stop.is_set():
            _logged(step)()
            self._stop.wait(seconds)

    def _shut_down(self) -> None:
        log.info("event=node_agent_stopping pods=%d", len(self.pods))
        threads = [threading.Thread(target=pod.stop, args=(min(pod.grace_seconds, SHUTDOWN_GRACE_SECONDS),))
                   for pod in self.pods.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for pod in self.pods.values():
            self._write(pod)
        _logged(self.registration.stopped)()
        self.prober.close()
        self.endpoint.close()


def _finished_elsewhere(manifest: node_api.Manifest) -> bool:
    return (manifest.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _logged(step: Callable[[], None], name: str = "") -> Callable[[], None]:
    """step, with an API or network error logged rather than ending its loop."""
    name = name or getattr(step, "__name__", repr(step))

    def run() -> None:
        try:
            step()
        except API_ERRORS as exc:
            log.warning("event=node_step_failed step=%r error=%s", name, exc)
        except Exception:
            log.exception("event=node_step_crashed step=%r", name)
    return run
