"""Jobs on a cluster, through the Kubernetes API with the user's kubeconfig as kubectl reads
it: --kubeconfig, else $KUBECONFIG (paths joined by ':'), else ~/.kube/config; --context,
else the current context; its namespace unless -n names one.

The official client's transport and cluster/kube.py's calls (their errors carry the API
server's own message). A pod's metrics come through the API server's pod proxy, or, with
$DISTBELIEF_METRICS_URL set, from that URL (the operator's setting of the same name, e.g.
a node agent's endpoint where the API server will not proxy).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TextIO

import yaml

from distbelief.operator import errors
from distbelief.operator.cluster.kube import Kube, path_of
from distbelief.operator.plugin import pods as pods_of
from distbelief.operator.plugin.views import Event, event_from_manifest
from distbelief.operator.status import scrape
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract

JOB = (contract.JOB_API_VERSION, contract.KIND)
METRICS_URL = os.environ.get("DISTBELIEF_METRICS_URL")


def connect(kubeconfig: str | None, context: str | None) -> tuple[Kube, str]:
    """The API, and the context's namespace (default when it names none)."""
    from kubernetes import client, config

    files = kubeconfig or config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION  # $KUBECONFIG, else ~/.kube/config
    try:
        contexts, _ = config.list_kube_config_contexts(config_file=files)
        wanted = context or current_context(files)
        chosen = next((c for c in contexts if c["name"] == wanted), None)
        if chosen is None:
            raise errors.OperatorError(f"no context {wanted!r} in the kubeconfig")
        configuration = client.Configuration()
        config.load_kube_config(config_file=files, context=chosen["name"], client_configuration=configuration)
    except (config.ConfigException, OSError, yaml.YAMLError) as exc:
        raise errors.OperatorError(f"kubeconfig {files}: {exc}") from None
    return Kube(client.ApiClient(configuration)), (chosen.get("context") or {}).get("namespace") or "default"


def current_context(files: str) -> str | None:
    """The current-context of the first of the ':'-joined files that sets one, as kubectl
    takes it (the client's merge would take the last)."""
    for path in files.split(os.pathsep):
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as f:
                found = (yaml.safe_load(f) or {}).get("current-context")
        except FileNotFoundError:
            continue
        if found:
            return found
    return None


class ClusterJobs:
    """The jobs of one namespace (or of all) on a cluster."""

    local = False

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube, self.namespace = kube, namespace

    def jobs(self, *, all_namespaces: bool = False) -> list[DistBeliefJob]:
        found = map(DistBeliefJob.of, self.kube.list(*JOB, None if all_namespaces else self.namespace, {}))
        return sorted(found, key=lambda j: (j.config.namespace, j.config.name))

    def job(self, name: str) -> DistBeliefJob:
        found = self.kube.get(*JOB, self.namespace, name)
        if found is None:
            raise errors.OperatorError(f"no {contract.KIND} {name!r} in namespace {self.namespace}")
        return DistBeliefJob.of(found)

    def pods(self, job: DistBeliefJob) -> list[pods_of.Pod]:
        found = self.kube.list("v1", "Pod", self.namespace, {contract.LABEL_JOB: job.config.name})
        return sorted(map(pods_of.from_manifest, found), key=lambda p: pods_of.sort_key(job.config, p))

    def events(self, job: DistBeliefJob) -> list[Event]:
        """The Events about the job itself, oldest first."""
        found = self.kube.list("v1", "Event", self.namespace, {}, fields={
            "involvedObject.kind": contract.KIND, "involvedObject.name": job.config.name,
            "involvedObject.uid": job.config.uid or ""})
        found.sort(key=lambda e: (e.get("lastTimestamp") or e.get("eventTime") or "",
                                  int(e["metadata"].get("resourceVersion", 0))))
        return [event_from_manifest(e) for e in found]

    def scale(self, name: str, replicas: int) -> None:
        """Through the scale subresource, as `kubectl scale` does: the API server checks the
        spec that results against the CRD's schema and rules."""
        self.kube.patch(*JOB, self.namespace, name, {"spec": {"replicas": replicas}}, subresource="scale")

    def suspend(self, name: str, suspended: bool) -> None:
        self.job(name)  # a missing job named as such, not as a failed patch
        self.kube.patch(*JOB, self.namespace, name, {"spec": {"runPolicy": {"suspend": suspended}}})

    def metrics(self, pod: pods_of.Pod) -> str:
        """The pod's /metrics text."""
        if METRICS_URL:
            url = METRICS_URL.format(namespace=self.namespace, pod=pod.name, port=contract.METRICS_PORT)
            return scrape.fetch(url).decode(errors="replace")
        path = f"{path_of('v1', 'Pod', self.namespace, pod.name)}:{contract.METRICS_PORT}/proxy/metrics"
        return self.kube.read_text(f"metrics of pod {self.namespace}/{pod.name}", path)

    def logs(self, pods: list[pods_of.Pod], *, follow: bool, out: TextIO = sys.stdout) -> None:
        """The pods' logs, each line after its pod's name when there are several; with follow,
        every pod's at once until each stream ends."""
        lock, failed = threading.Lock(), []

        def show(pod: pods_of.Pod) -> None:
            prefix = f"[{pod.name}] " if len(pods) > 1 else ""
            path = path_of("v1", "Pod", self.namespace, pod.name, "log")
            try:
                for line in self.kube.stream_lines(f"log of pod {self.namespace}/{pod.name}", path,
                                                   [("follow", "true")] if follow else []):
                    with lock:
                        out.write(prefix + line.decode(errors="replace").rstrip("\n") + "\n")
                        out.flush()
            except errors.KubeError as exc:
                failed.append(exc)

        threads = [threading.Thread(target=show, args=(pod,), daemon=True) for pod in pods]
        for thread in threads:  # one at a time unless followed: each pod's log whole, in turn
            thread.start()
            if not follow:
                thread.join()
        for thread in threads:
            thread.join()
        if failed:
            raise failed[0]

