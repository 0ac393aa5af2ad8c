"""A job's children on a real control plane: the operator puts back what is deleted or
changed (level-triggered: it watches every kind it owns), and changes nothing it does not
own, whoever asks. The operator runs as the chart's ServiceAccount (support/cluster.py)."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import pytest
import yaml

from support.cluster import JOBS, Api, Kubectl, Operator

from support.kubejobs import apply, condition, controller_of, new_job, patch_job

pytestmark = pytest.mark.floors  # the operator's API calls, also against the lowest dependency versions

HPA, POLICY = "autoscaling/v2/horizontalpodautoscalers", "networking.k8s.io/v1/networkpolicies"
PDB = "policy/v1/poddisruptionbudgets"
# Every kind of child, and an edit a user might make to it, that the operator undoes.
KINDS: list[tuple[str, str, Callable[[str], dict[str, Any]], Callable[[dict[str, Any]], bool]]] = [
    ("v1/configmaps", "{}-config", lambda job: {"data": {"job.json": "{}"}},
     lambda cm: cm["data"]["job.json"] != "{}"),
    ("v1/services", "{}-ps", lambda job: {"spec": {"publishNotReadyAddresses": False}},
     lambda svc: svc["spec"].get("publishNotReadyAddresses") is True),
    ("apps/v1/statefulsets", "{}-ps", lambda job: {"spec": {"replicas": 5}},
     lambda sts: sts["spec"]["replicas"] == 2),
    ("apps/v1/deployments", "{}-worker", lambda job: {"spec": {"template": {"spec": {"containers": [
        {"name": "worker", "image": "evil.example/miner:1"}]}}}},
     lambda d: d["spec"]["template"]["spec"]["containers"][0]["image"] != "evil.example/miner:1"),
    (PDB, "{}-ps", lambda job: {"spec": {"maxUnavailable": 2}}, lambda pdb: pdb["spec"]["maxUnavailable"] == 1),
    (HPA, "{}-worker", lambda job: {"spec": {"maxReplicas": 50}}, lambda hpa: hpa["spec"]["maxReplicas"] == 6),
    (POLICY, "{}-ps", lambda job: {"spec": {"ingress": [{}]}}, lambda policy: policy["spec"]["ingress"] != [{}]),
]
IDS = [resource.split("/")[-1] for resource, *_ in KINDS]


def autoscaled(name: str) -> dict[str, Any]:
    return new_job(name, workers={"autoscaling": {"minReplicas": 2, "maxReplicas": 6}})


@pytest.mark.parametrize("resource, pattern, edit, undone", KINDS, ids=IDS)
def test_a_deleted_child_is_made_again(operator: Operator, api: Api, kubectl: Kubectl, namespace: str,
                                       resource: str, pattern: str, edit: Any, undone: Any) -> None:
    apply(kubectl, namespace, autoscaled("del"))
    name = pattern.format("del")
    before = api.wait(resource, namespace, name)
    api.wait(JOBS, namespace, "del", lambda j: condition(j, "Created")["status"] == "True"
             if (j.get("status") or {}).get("conditions") else False)
    api.delete(resource, namespace, name)
    again = api.wait(resource, namespace, name, lambda o: o is not None and o["metadata"]["uid"] != before["metadata"]["uid"])
    assert controller_of(again)["uid"] == controller_of(before)["uid"]
    event = api.wait_event(namespace, "del", "ChildRestored")
    assert name in event["message"] and "was deleted" in event["message"]


@pytest.mark.parametrize("resource, pattern, edit, undone", KINDS, ids=IDS)
def test_a_changed_child_is_changed_back(operator: Operator, api: Api, kubectl: Kubectl, namespace: str,
                                         resource: str, pattern: str, edit: Any, undone: Any) -> None:
    apply(kubectl, namespace, autoscaled("edit"))
    name = pattern.format("edit")
    api.wait(resource, namespace, name)
    api.wait(JOBS, namespace, "edit", lambda j: condition(j, "Created")["status"] == "True"
             if (j.get("status") or {}).get("conditions") else False)
    kind = resource.split("/")[-1]
    kubectl("patch", kind, name, "-n", namespace, "--type", "strategic" if kind in (
        "deployments", "statefulsets", "services", "configmaps") else "merge", "-p", json.dumps(edit("edit")))
    api.wait(resource, namespace, name, undone)
    assert "differed from the job" in api.wait_event(namespace, "edit", "ChildRestored")["message"]


def test_a_settled_job_is_left_alone(operator: Operator, api: Api, kubectl: Kubectl, namespace: str) -> None:
    """Watching its own children, the operator must not keep rewriting them: once a job's
    children match, their resourceVersions stay (the controllers write only status, which a
    patch of the operator would show as a metadata.generation change)."""
    doc = new_job("calm", workers={"resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"}}})
    apply(kubectl, namespace, doc)
    api.wait(JOBS, namespace, "calm", lambda j: bool((j.get("status") or {}).get("conditions")))
    time.sleep(3)
    generations = {r: api.get(r, namespace, n)["metadata"].get("generation")
                   for r, n in (("apps/v1/statefulsets", "calm-ps"), ("apps/v1/deployments", "calm-worker"))}
    config = api.get("v1/configmaps", namespace, "calm-config")["metadata"]["resourceVersion"]
    time.sleep(4)  # several status intervals
    assert generations == {r: api.get(r, namespace, n)["metadata"].get("generation")
                           for r, n in (("apps/v1/statefulsets", "calm-ps"), ("apps/v1/deployments", "calm-worker"))}
    assert api.get("v1/configmaps", namespace, "calm-config")["metadata"]["resourceVersion"] == config
    assert "ChildRestored" not in {e["reason"] for e in api.events(namespace, "calm")}


# ------------------------------------------------------------------ what the job does not own


@pytest.fixture
def job_user(api: Api, kubectl: Kubectl, chart: str, namespace: str, control_plane: Any) -> Kubectl:
    """kubectl as a user who may only run DistBeliefJobs in the namespace (the chart's -edit
    ClusterRole, bound there), not touch StatefulSets, Deployments or NetworkPolicies."""
    (role,) = [r["metadata"]["name"] for r in api.list("rbac.authorization.k8s.io/v1/clusterroles", None,
                                                      "app.kubernetes.io/name=distbelief")
               if r["metadata"]["name"].endswith("-edit")]
    api.create("rbac.authorization.k8s.io/v1/rolebindings", namespace, {
        "metadata": {"name": "jobs-only"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                      "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "User", "name": "user", "apiGroup": "rbac.authorization.k8s.io"}]})
    user = kubectl.as_user(control_plane.user_token)
    assert user("auth", "can-i", "create", "statefulsets", "-n", namespace, check=False).strip() == "no"
    assert user("auth", "can-i", "create", "distbeliefjobs", "-n", namespace).strip() == "yes"
    return user


def someone_elses(kind: str, name: str) -> dict[str, Any]:
    labels = {"app": "someone-else"}
    pod = {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "app", "image": "their/app:1"}]}}
    if kind == "StatefulSet":
        return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name}, "spec": {
            "replicas": 1, "serviceName": name, "selector": {"matchLabels": labels}, "template": pod}}
    if kind == "Deployment":
        return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name}, "spec": {
            "replicas": 1, "selector": {"matchLabels": labels}, "template": pod}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": kind, "metadata": {"name": name}, "spec": {
        "podSelector": {"matchLabels": labels}, "policyTypes": ["Ingress"], "ingress": [{}]}}


def untouched(before: dict[str, Any], after: dict[str, Any] | None) -> bool:
    """after is before, save what the controllers write (status): same object, same spec
    (generation), same labels and owners, and no writer but its creator and the controllers."""
    if after is None:
        return False
    writers = {f["manager"] for f in after["metadata"]["managedFields"]}

    def users(meta: dict[str, Any]) -> dict[str, Any]:  # the Deployment controller's revision aside
        return {k: v for k, v in (meta.get("annotations") or {}).items() if not k.startswith("deployment.kubernetes")}

    return all(after["metadata"].get(k) == before["metadata"].get(k) for k in (
        "uid", "generation", "labels", "ownerReferences")) and users(after["metadata"]) == users(before["metadata"]) \
        and writers <= {f["manager"] for f in before["metadata"]["managedFields"]} | {"kube-controller-manager"}


@pytest.mark.parametrize("kind, name", [("StatefulSet", "app-ps"), ("Deployment", "app-worker")])
def test_another_applications_workload_is_never_rewritten(operator: Operator, api: Api, kubectl: Kubectl,
                                                          job_user: Kubectl, namespace: str, kind: str,
                                                          name: str) -> None:
    """A user who may only create DistBeliefJobs names a job after another application: its
    <name>-ps StatefulSet or <name>-worker Deployment stays exactly as it was, the job says
    why it does not start, and nothing is created in the foreign object's place."""
    theirs = someone_elses(kind, name)
    resource = f"apps/v1/{kind.lower()}s"
    before = api.create(resource, namespace, theirs)
    job_user("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(new_job("app")))
    job = api.wait(JOBS, namespace, "app", lambda j: bool((j.get("status") or {}).get("conditions"))
                   and condition(j, "Created")["reason"] == "ForeignObject")
    created = condition(job, "Created")
    assert created["status"] == "False" and f"{kind}/{name}" in created["message"]
    warning = api.wait_event(namespace, "app", "ForeignObject")
    assert warning["type"] == "Warning" and f"{kind}/{name}" in warning["message"]
    time.sleep(2)  # a retry, a watch event: neither may touch it
    after = api.get(resource, namespace, name)
    assert untouched(before, after)
    assert after["spec"]["template"]["spec"]["containers"][0]["image"] == "their/app:1"
    assert job["status"]["phase"] == "Pending"
    # When the other application's object goes, the job starts.
    api.delete(resource, namespace, name)
    mine = api.wait(resource, namespace, name, lambda o: o is not None and o["metadata"].get("ownerReferences"))
    assert controller_of(mine)["uid"] == job["metadata"]["uid"]
    api.wait(JOBS, namespace, "app", lambda j: condition(j, "Created")["status"] == "True")


def test_another_applications_network_policy_is_never_deleted(operator: Operator, api: Api, kubectl: Kubectl,
                                                              job_user: Kubectl, namespace: str) -> None:
    """networkPolicy: false removes the job's own NetworkPolicy <job>-ps, never someone else's."""
    before = api.create(POLICY, namespace, someone_elses("NetworkPolicy", "open-ps"))
    doc = new_job("open", parameterServers={"networkPolicy": False})
    job_user("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    api.wait("apps/v1/statefulsets", namespace, "open-ps")
    api.wait(JOBS, namespace, "open", lambda j: bool((j.get("status") or {}).get("conditions"))
             and condition(j, "Created")["status"] == "True")
    time.sleep(2)
    assert untouched(before, api.get(POLICY, namespace, "open-ps"))
    # ... and its own one, once made, does go when the spec turns it off.
    api.delete(POLICY, namespace, "open-ps")
    patch_job(kubectl, namespace, "open", {"spec": {"parameterServers": {"networkPolicy": True}}})
    api.wait(POLICY, namespace, "open-ps")
    patch_job(kubectl, namespace, "open", {"spec": {"parameterServers": {"networkPolicy": False}}})
    api.wait(POLICY, namespace, "open-ps", lambda o: o is None)
