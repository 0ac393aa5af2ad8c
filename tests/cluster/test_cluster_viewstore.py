"""The shard copies' view in a Lease (shard/copies/kubelease.py) on a real kube-apiserver 1.36:
a write naming a stale resourceVersion is refused (409), of threads that read the same
version exactly one writes, and the shard pods' rendered ServiceAccount may keep its job's
Leases and nothing else, through the runtime's own stdlib client, with the pod's in-cluster
credentials."""

from __future__ import annotations

import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from distbelief.operator.render import context, render
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract
from distbelief.runtime.shard.copies import kubelease, stores
from distbelief.runtime.shard.copies.kubeapi import KubeApi
from distbelief.runtime.shard.copies.viewstore import StoreUnavailable, ViewRecord
from support.cluster import Kubectl
from support.controlplane import ControlPlane

from support.examples import load_example
from support.waiting import eventually


def record(view: int, primary: int = 0) -> ViewRecord:
    return ViewRecord(view=view, primary=primary, in_sync=((primary, f"i{view}"),), holder=f"i{view}",
                      renewed=time.time(), lease_seconds=3.0, failovers=view - 1)


def admin(plane: ControlPlane) -> KubeApi:
    return KubeApi(plane.server, token=plane.admin_token, ca_file=str(plane.dir / "certs" / "apiserver.crt"))


def lease(plane: ControlPlane, namespace: str, name: str = "job-shard-0") -> kubelease.LeaseViewStore:
    return kubelease.LeaseViewStore(admin(plane), namespace=namespace, name=name)


def test_a_lease_is_written_only_over_the_version_read(control_plane: ControlPlane, namespace: str,
                                                       kubectl: Kubectl) -> None:
    store = lease(control_plane, namespace)
    assert store.read() == (None, "")
    first = store.compare_and_swap("", record(1))
    assert first
    assert lease(control_plane, namespace).compare_and_swap("", record(1)) is None  # created already: 409
    read, version = lease(control_plane, namespace).read()
    assert (read.view, read.primary, read.in_sync, read.failovers, version) == (1, 0, ((0, "i1"),), 0, first)
    second = store.compare_and_swap(first, record(2, primary=1))
    assert second and second != first
    assert lease(control_plane, namespace).compare_and_swap(first, record(3)) is None  # stale: 409
    live = kubectl.json("get", "lease", "job-shard-0", "-n", namespace)
    assert live["spec"]["holderIdentity"] == "i2" and live["spec"]["leaseTransitions"] == 2
    assert live["metadata"]["annotations"]["distbelief.io/primary"] == "1"


def test_of_threads_that_read_the_same_lease_version_exactly_one_writes(control_plane: ControlPlane,
                                                                        namespace: str) -> None:
    _, version = lease(control_plane, namespace).read()
    start, wins = threading.Barrier(8), []

    def claim(i: int) -> None:
        store = lease(control_plane, namespace)
        start.wait()
        if store.compare_and_swap(version, record(1, primary=i)) is not None:
            wins.append(i)

    for rounds in range(2):  # the create race, then an update race
        threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == rounds + 1
        assert lease(control_plane, namespace).read()[0].primary == wins[-1]
        _, version = lease(control_plane, namespace).read()


def pod_credentials(plane: ControlPlane, kubectl: Kubectl, namespace: str, folder: Path) -> dict[str, str]:
    """The rendered account's token, the cluster's CA and the namespace where a pod has them,
    and the environment that points at the API server."""
    doc = load_example("digits-mlp.yaml")
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["parameterServers"]["backups"] = 1
    objs = [o for o in render.render_children(DistBeliefJob.validated(doc), image=context.DEFAULT_IMAGE)
            if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    kubectl("apply", "-f", "-", input=render.to_yaml(objs))
    token = kubectl("create", "token", "digits-ps", "-n", namespace, "--duration=1h").strip()
    (folder / "token").write_text(token)
    (folder / "ca.crt").write_bytes((plane.dir / "certs" / "apiserver.crt").read_bytes())
    (folder / "namespace").write_text(namespace)
    url = urllib.parse.urlsplit(plane.server)
    return {"KUBERNETES_SERVICE_HOST": url.hostname, "KUBERNETES_SERVICE_PORT": str(url.port)}


def test_the_shard_pods_account_keeps_its_jobs_leases_and_nothing_else(
        control_plane: ControlPlane, kubectl: Kubectl, namespace: str, tmp_path: Path) -> None:
    environ = pod_credentials(control_plane, kubectl, namespace, tmp_path)
    api, own_namespace = KubeApi.in_cluster(root=str(tmp_path), environ=environ)
    assert own_namespace == namespace and api.account() is not None
    config = contract.JobNames("digits")
    # The test's folder stands for /var/run/secrets/kubernetes.io/serviceaccount.
    store = stores.open_store(config, 1, {**environ, contract.ENV_VIEW_STORE: "kubernetes"},
                              service_account=str(tmp_path))
    assert isinstance(store, kubelease.LeaseViewStore)
    version = store.compare_and_swap("", record(1))
    assert version and store.compare_and_swap(version, record(2))
    live = kubectl.json("get", "lease", "digits-shard-1", "-n", namespace)
    (owner,) = live["metadata"]["ownerReferences"]
    account = kubectl.json("get", "serviceaccount", "digits-ps", "-n", namespace)
    assert (owner["kind"], owner["name"], owner["uid"]) == ("ServiceAccount", "digits-ps", account["metadata"]["uid"])
    other = kubelease.LeaseViewStore(api, namespace=namespace, name="other-shard-0")
    with pytest.raises(StoreUnavailable, match="HTTP 403"):
        other.read()  # another job's Lease: not named in the Role
    status, _ = api.call("GET", f"/api/v1/namespaces/{namespace}/secrets")
    assert status == 403
    status, _ = api.call("GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases")
    assert status == 403  # no list: a name is needed
    # The Lease goes with the account, which goes with the job (garbage collection).
    kubectl("delete", "serviceaccount", "digits-ps", "-n", namespace)
    eventually(lambda: kubectl.run("get", "lease", "digits-shard-1", "-n", namespace).returncode != 0, 60,
               interval=0.5, what="the Lease gone with its owner")
