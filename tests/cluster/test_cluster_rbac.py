"""The chart's RBAC is exactly what the operator needs, checked both ways on a real API server.

The operator runs as the chart's ServiceAccount, installed by helm once watching every
namespace (the session's release) and once a list of them (a second release), and drives
one job through its whole life. The server's audit log records every request it made:

* no request was refused (every test using the `operator` fixture checks that too);
* every rule the chart grants was used by some request, so no rule can stay once the
  operator stops needing it. The one grant no request uses, update on the jobs'
  finalizers, is what the admission plugin OwnerReferencesPermissionEnforcement checks
  when a child with blockOwnerDeletion is created: a test here shows it is refused without.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from support import controlplane, kueue
from support.chiefs import Chiefs
from support.cluster import CHART, JOBS, Api, Kubectl, Operator, refused
from support.chartdocs import Grant, operator_grants
from support.kubejobs import apply, kubelet_runs, new_job, patch_job, phase_is, pods_of, replicas_are, reshard_pod_ends
from support.waiting import eventually

pytestmark = pytest.mark.floors  # the operator's API calls, also against the lowest dependency versions

# Grants no request uses, which the API server's own checks require (admission, RBAC
# escalation): (group, resource, verb) -> why they stay. Keep it this short: an entry is a
# permission that only a test of its own shows the operator needs.
REQUIRED_BY_SERVER_CHECKS = {
    ("distbelief.io", "distbeliefjobs/finalizers", "update"):
        "OwnerReferencesPermissionEnforcement: the children's blockOwnerDeletion "
        "(test_block_owner_deletion_needs_update_on_the_jobs_finalizers)",
    **{("coordination.k8s.io", "leases", verb): "granted on to the shard pods' Role (a Role may grant only what "
                                                "its maker holds); the shard copies use it, the operator never does"
       for verb in ("get", "create", "update")},
}


@dataclasses.dataclass(frozen=True)
class Call:
    """One request as RBAC sees it."""

    group: str
    resource: str          # plural, or plural/subresource
    verb: str
    namespace: str | None  # None: cluster-scoped, or across all namespaces
    name: str | None


def call_of(event: dict[str, Any]) -> Call | None:
    """An audit event as (group, resource[/subresource], verb, namespace, name); None for a
    path that is no resource (discovery, health)."""
    ref = event.get("objectRef")
    if not ref or not ref.get("resource"):
        return None
    resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
    return Call(ref.get("apiGroup", ""), resource, event["verb"], ref.get("namespace"), ref.get("name"))


def allows(grant: Grant, call: Call, *, any_namespace: bool = False) -> bool:
    if (call.group, call.resource, call.verb) != (grant.group, grant.resource, grant.verb):
        return False
    if grant.namespace is not None and call.namespace != grant.namespace and not any_namespace:
        return False
    return grant.name is None or call.name == grant.name


def installed_grants(api: Api, release_namespace: str) -> list[Grant]:
    """The grants the installed release gives its operator, from the objects helm created."""
    rbac = "rbac.authorization.k8s.io/v1"
    docs = [{**d, "kind": "Deployment"} for d in api.list("apps/v1/deployments", release_namespace,
                                                          "app.kubernetes.io/name=distbelief")]
    for plural, kind in (("clusterroles", "ClusterRole"), ("clusterrolebindings", "ClusterRoleBinding"),
                         ("roles", "Role"), ("rolebindings", "RoleBinding")):
        docs += [{**obj, "kind": kind} for obj in api.list(f"{rbac}/{plural}", None, "app.kubernetes.io/name=distbelief")]
    return operator_grants(docs)


def unused(grants: list[Grant], calls: list[Call]) -> list[str]:
    """The grants no call used (a Role's grant counts as used when the same grant was used in
    any watched namespace: the job ran in the first)."""
    return sorted({str(g) for g in grants if (g.group, g.resource, g.verb) not in REQUIRED_BY_SERVER_CHECKS
                   and not any(allows(g, c, any_namespace=True) for c in calls)})


def drive_a_job_through_its_life(api: Api, kubectl: Kubectl, chiefs: Chiefs, namespace: str) -> None:
    """create, kubectl scale, autoscaling (on, changed, off), NetworkPolicy (on, a port change,
    off), a child deleted and one changed, running, finished, deleted by its TTL."""
    name = "rbac"
    apply(kubectl, namespace, new_job(name, runPolicy={"ttlSecondsAfterFinished": 1}))
    api.wait("apps/v1/statefulsets", namespace, f"{name}-ps")
    api.wait("apps/v1/deployments", namespace, f"{name}-worker")
    kubectl("scale", f"dbj/{name}", "--replicas=5", "-n", namespace)
    api.wait("apps/v1/deployments", namespace, f"{name}-worker", replicas_are(5))
    hpas, policies = "autoscaling/v2/horizontalpodautoscalers", "networking.k8s.io/v1/networkpolicies"
    patch_job(kubectl, namespace, name, {"spec": {"workers": {"autoscaling": {"minReplicas": 2, "maxReplicas": 6}}}})
    api.wait(hpas, namespace, f"{name}-worker")
    patch_job(kubectl, namespace, name, {"spec": {"workers": {"autoscaling": {"maxReplicas": 7}}}})
    api.wait(hpas, namespace, f"{name}-worker", lambda h: h and h["spec"]["maxReplicas"] == 7)
    patch_job(kubectl, namespace, name, {"spec": {"parameterServers": {"port": 7071}}})
    api.wait(policies, namespace, f"{name}-ps", lambda n: n and n["spec"]["ingress"][0]["ports"][0]["port"] == 7071)
    api.wait("v1/services", namespace, f"{name}-ps", lambda s: any(p["port"] == 7071 for p in s["spec"]["ports"]))
    patch_job(kubectl, namespace, name, {"spec": {"parameterServers": {"networkPolicy": False}}})
    api.wait(policies, namespace, f"{name}-ps", lambda n: n is None)
    patch_job(kubectl, namespace, name, {"spec": {"workers": {"autoscaling": None}}})
    api.wait(hpas, namespace, f"{name}-worker", lambda h: h is None)
    # Backups: the shard pods' ServiceAccount, Role and RoleBinding; edited by someone, put back.
    access = {"v1/serviceaccounts": {"automountServiceAccountToken": True},
              "rbac.authorization.k8s.io/v1/roles": {"rules": []},
              "rbac.authorization.k8s.io/v1/rolebindings": {"subjects": []}}
    patch_job(kubectl, namespace, name, {"spec": {"parameterServers": {"backups": 1}}})
    for resource, edit in access.items():
        api.wait(resource, namespace, f"{name}-ps")
        api.patch(resource, namespace, f"{name}-ps", edit)
    patch_job(kubectl, namespace, name, {"spec": {"training": {"evalEverySeconds": 7}}})
    for resource, edit in access.items():
        api.wait(resource, namespace, f"{name}-ps", lambda o, edit=edit: any(o.get(k) != v for k, v in edit.items()))
    budgets = "policy/v1/poddisruptionbudgets"
    api.patch(budgets, namespace, f"{name}-ps", {"spec": {"maxUnavailable": 2}})
    api.wait(budgets, namespace, f"{name}-ps", lambda b: b["spec"]["maxUnavailable"] == 1)
    api.delete("v1/configmaps", namespace, f"{name}-config")
    api.wait("v1/configmaps", namespace, f"{name}-config")
    pods_of(api, namespace, name, 4, "ps")  # two shards, two copies each

    def running(job: Any) -> bool:  # pods roll after the port change: the kubelet's part, until all run
        kubelet_runs(api, namespace, name)
        return phase_is("Running")(job)

    api.wait(JOBS, namespace, name, running)
    _, chief = chiefs.of(namespace, name)
    chief.finished.labels(reason="MaxStepsReached", outcome="Succeeded").set(1)
    api.wait(JOBS, namespace, name, lambda j: j is None or j["metadata"].get("deletionTimestamp"), timeout=60)


def drive_a_queued_job(api: Api, kubectl: Kubectl, namespace: str) -> None:
    """A job in a Kueue queue: its Workload created and read, made anew when the job is
    scaled while it waits, admitted (the ResourceFlavor read), scaled while it runs (suspended
    and queued again), admitted again, evicted (the admission given back in the Workload's
    status), deleted."""
    kueue.install_crds(kubectl)
    kueue.flavor(kubectl, "rbac-flavor", {"example.com/pool": "rbac"}, [])
    doc = new_job("rbac-queued")
    doc["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team"}
    apply(kubectl, namespace, doc)
    workloads, name = f"{kueue.GROUP}/{kueue.VERSION}/workloads", "distbeliefjob-rbac-queued"
    api.wait(workloads, namespace, name)
    kubectl("scale", "dbj/rbac-queued", "--replicas=4", "-n", namespace)
    api.wait(workloads, namespace, name, lambda w: w and {s["name"]: s["count"] for s in w["spec"]["podSets"]}["worker"] == 4)
    kueue.admit(kubectl, namespace, name, "rbac-flavor")
    api.wait(JOBS, namespace, "rbac-queued", lambda j: j and not j["spec"]["runPolicy"]["suspend"])
    kubectl("scale", "dbj/rbac-queued", "--replicas=5", "-n", namespace)  # re-queued with a new Workload
    api.wait(JOBS, namespace, "rbac-queued", lambda j: j["spec"]["runPolicy"]["suspend"])
    api.wait(workloads, namespace, name, lambda w: w and {s["name"]: s["count"] for s in w["spec"]["podSets"]}["worker"] == 5)
    api.wait("apps/v1/deployments", namespace, "rbac-queued-worker", lambda d: d["spec"]["replicas"] == 0)
    kueue.admit(kubectl, namespace, name, "rbac-flavor")
    api.wait(JOBS, namespace, "rbac-queued", lambda j: j and not j["spec"]["runPolicy"]["suspend"])
    kueue.evict(kubectl, namespace, name)
    api.wait(workloads, namespace, name, lambda w: w and not (w.get("status") or {}).get("admission"))
    api.delete(JOBS, namespace, "rbac-queued")


def drive_a_reshard(api: Api, kubectl: Kubectl, namespace: str) -> None:
    """A job's shard count changed: its pods stopped, the new shard pod's claim made, the
    reshard Job created and read; once it succeeded, deleted."""
    apply(kubectl, namespace, new_job("rbac-reshard"))
    pods_of(api, namespace, "rbac-reshard", 2, "ps")
    patch_job(kubectl, namespace, "rbac-reshard", {"spec": {"parameterServers": {"shards": 3}}})
    reshard_pod_ends(api, namespace, "rbac-reshard", 0, "resharded from 2 to 3 shards at step 1")
    api.wait("batch/v1/jobs", namespace, "rbac-reshard-reshard", lambda j: j is None)
    api.wait("apps/v1/statefulsets", namespace, "rbac-reshard-ps", replicas_are(3))
    api.delete(JOBS, namespace, "rbac-reshard")


def session(operator: Operator, api: Api, kubectl: Kubectl, chiefs: Chiefs, namespace: str,
            release_namespace: str) -> tuple[list[Call], list[Grant]]:
    """The operator started afresh (its startup's lists and watches count) and a job's life:
    the operator's calls and the release's grants."""
    _, start = operator.calls()
    operator.restart()
    drive_a_job_through_its_life(api, kubectl, chiefs, namespace)
    drive_a_queued_job(api, kubectl, namespace)
    drive_a_reshard(api, kubectl, namespace)
    time.sleep(1)
    events, _ = operator.calls(start, started=True)
    assert not refused(events), f"refused: {refused(events)}\n{operator.log_tail(3000)}"
    return [c for c in map(call_of, events) if c is not None], installed_grants(api, release_namespace)


def test_every_grant_of_the_chart_is_used_watching_every_namespace(
        operator: Operator, api: Api, kubectl: Kubectl, chiefs: Chiefs, chart: str, namespace: str) -> None:
    calls, grants = session(operator, api, kubectl, chiefs, namespace, chart)
    assert all(any(allows(g, c) for g in grants) for c in calls)
    assert not unused(grants, calls), f"the chart grants what the operator never used: {unused(grants, calls)}"
    assert {g.namespace for g in grants} == {None}   # one ClusterRole
    assert any(c.resource == "clusterkopfpeerings" and c.verb == "patch" for c in calls)


@pytest.fixture
def scoped_release(helm: Callable[..., str], kubectl: Kubectl, api: Api, operator_process: Operator,
                   control_plane: controlplane.ControlPlane, chiefs: Chiefs,
                   tmp_path: Path) -> Iterator[tuple[Operator, list[str]]]:
    """A second release of the chart that watches two namespaces (Roles there, not cluster-wide
    rules), and its operator; the session's operator is stopped meanwhile, so that one operator
    acts on the jobs there."""
    watched = [f"scoped-{i}-{int(time.time() * 1000) % 100000}" for i in (1, 2)]
    for name in watched:
        kubectl("create", "namespace", name)
    release_namespace = f"distbelief-scoped-{int(time.time() * 1000) % 100000}"
    helm("install", "scoped", str(CHART), "--namespace", release_namespace, "--create-namespace", "--skip-crds",
         "--set", "operator.watchNamespaces={" + ",".join(watched) + "}", "--set", "rbac.aggregateToDefaultRoles=false")
    operator_process.stop()
    scoped = Operator(control_plane, kubectl, release_namespace, chiefs, tmp_path)
    try:
        yield scoped, watched
    finally:
        scoped.stop()
        operator_process.start()
        helm("uninstall", "scoped", "--namespace", release_namespace)
        for name in [*watched, release_namespace]:
            kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_every_grant_of_the_chart_is_used_watching_a_list_of_namespaces(
        scoped_release: tuple[Operator, list[str]], api: Api, kubectl: Kubectl, chiefs: Chiefs) -> None:
    operator, watched = scoped_release
    calls, grants = session(operator, api, kubectl, chiefs, watched[0], operator.namespace)
    assert all(any(allows(g, c) for g in grants) for c in calls)
    assert not unused(grants, calls), f"the chart grants what the operator never used: {unused(grants, calls)}"
    # Cluster-wide, only reading namespaces, CRDs and Kueue's ResourceFlavors; everything else
    # in the watched namespaces' Roles.
    assert {(g.group, g.resource, g.verb) for g in grants if g.namespace is None} == {
        ("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")} | {
        ("", "namespaces", v) for v in ("list", "watch")} | {("kueue.x-k8s.io", "resourceflavors", "get")}
    assert {g.namespace for g in grants} == {None, *watched}
    assert {c.namespace for c in calls} <= {None, *watched}
    for name in watched:  # the operator reads jobs and keeps peering in both
        assert {("distbeliefjobs", "watch"), ("kopfpeerings", "patch")} <= {
            (c.resource, c.verb) for c in calls if c.namespace == name}


def test_block_owner_deletion_needs_update_on_the_jobs_finalizers(
        api: Api, kubectl: Kubectl, chart: str, namespace: str, control_plane: controlplane.ControlPlane) -> None:
    """Why the chart grants a verb the operator never calls: without it, the server refuses
    every child, since each names its job with blockOwnerDeletion."""
    job = apply(kubectl, namespace, new_job("owner", runPolicy={"suspend": True}))
    rbac = "rbac.authorization.k8s.io/v1"
    api.create("v1/serviceaccounts", namespace, {"metadata": {"name": "maker"}})
    rules = [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]}]
    api.create(f"{rbac}/roles", namespace, {"metadata": {"name": "maker"}, "rules": rules})
    api.create(f"{rbac}/rolebindings", namespace, {
        "metadata": {"name": "maker"}, "roleRef": {"apiGroup": rbac.split("/")[0], "kind": "Role", "name": "maker"},
        "subjects": [{"kind": "ServiceAccount", "name": "maker", "namespace": namespace}]})
    maker = kubectl.as_user(kubectl("create", "token", "maker", "-n", namespace).strip())

    def child(name: str) -> str:
        return yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "ownerReferences": [
            {"apiVersion": "distbelief.io/v1alpha1", "kind": "DistBeliefJob", "name": "owner",
             "uid": job["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]}})

    done = maker.run("create", "-n", namespace, "-f", "-", input=child("first"))
    assert done.returncode != 0 and "blockOwnerDeletion" in done.stderr, done.stderr
    rules.append({"apiGroups": ["distbelief.io"], "resources": ["distbeliefjobs/finalizers"], "verbs": ["update"]})
    api.patch(f"{rbac}/roles", namespace, "maker", {"rules": rules})
    # RBAC changes take effect within moments
    eventually(lambda: maker.run("create", "-n", namespace, "-f", "-", input=child("second")).returncode == 0, 30,
               interval=0.5, what="the create allowed once the role grants the finalizers")
