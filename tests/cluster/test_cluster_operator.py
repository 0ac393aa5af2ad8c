"""The operator on a real control plane: the chart installed with helm, `distbelief operator`
running as the chart's ServiceAccount (exactly the chart's RBAC: a refused request fails
the test), jobs driven as a user drives them, with kubectl.

The real controllers act on what the operator creates (ReplicaSets, pods, the StatefulSet's
claims, garbage collection). There is no kubelet: the test plays it where a flow needs pods
to run (pod status, as a kubelet writes it), and plays the chiefs (support/chiefs.py).
"""

from __future__ import annotations

import base64
import copy
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import config as kube_config

from distbelief.operator.cluster import locks, resharding
from distbelief.operator.cluster.kube import Kube
from distbelief.operator.validation import spec as job_spec
from distbelief.runtime import keys
from support.chiefs import Chiefs
from support.cluster import CRD_NAME, JOBS, Api, Kubectl, Operator, stop_process, unavailable
from support.controlplane import ControlPlane
from support.examples import load_example
from support.kubejobs import (READY, apply, condition, condition_holds, controller_of, kubelet_runs, new_job,
                              patch_job, pending_reshard_pods, phase_is, pods_of, replicas_are, reshard_pod_ends)
from support.waiting import eventually

pytestmark = pytest.mark.floors  # the operator's API calls, also against the lowest dependency versions

STS, DEPLOY = "apps/v1/statefulsets", "apps/v1/deployments"
CHILDREN = [("v1/secrets", "{}-keys"), ("v1/configmaps", "{}-config"), ("v1/services", "{}-ps"),
            (STS, "{}-ps"), (DEPLOY, "{}-worker")]


# ------------------------------------------------------------------ create


def test_create_makes_the_children_owned_by_the_job(operator: Operator, api: Api, kubectl: Kubectl,
                                                    namespace: str) -> None:
    job = apply(kubectl, namespace, new_job("create"))
    uid = job["metadata"]["uid"]
    for resource, pattern in CHILDREN:
        child = api.wait(resource, namespace, pattern.format("create"))
        owner = controller_of(child)
        assert (owner["kind"], owner["uid"], owner["blockOwnerDeletion"]) == ("DistBeliefJob", uid, True)
    assert api.get(STS, namespace, "create-ps")["spec"]["replicas"] == 2
    assert api.get(DEPLOY, namespace, "create-worker")["spec"]["replicas"] == 3
    # The real controllers take it from there: the shards' pods and their checkpoint claims.
    pods_of(api, namespace, "create", 2, "ps")
    claims = {c["metadata"]["name"] for c in api.list("v1/persistentvolumeclaims", namespace)}
    assert claims == {"checkpoints-create-ps-0", "checkpoints-create-ps-1"}
    job = api.wait(JOBS, namespace, "create", condition_holds("Created"))
    assert job["metadata"]["annotations"]["distbelief.io/shards"] == "2"
    api.wait_event(namespace, "create", "ChildrenApplied")
    with urllib.request.urlopen(operator.liveness, timeout=5) as response:
        assert response.status == 200


def test_a_new_jobs_children_are_created_without_reading_them_first(operator: Operator, api: Api,
                                                                     kubectl: Kubectl, namespace: str) -> None:
    _, start = operator.calls()
    apply(kubectl, namespace, new_job("lean"))
    for resource, pattern in CHILDREN:
        api.wait(resource, namespace, pattern.format("lean"))
    time.sleep(1)  # the audit log is written as each request completes
    calls, _ = operator.calls(start)
    ours = [c for c in calls if (c.get("objectRef") or {}).get("namespace") == namespace
            and (c["objectRef"].get("name") or "").startswith("lean-")
            or (c["verb"] == "create" and (c.get("objectRef") or {}).get("namespace") == namespace
                and c["objectRef"]["resource"] not in ("events", "distbeliefjobs"))]
    creates = [i for i, c in enumerate(ours) if c["verb"] == "create"]
    assert len(creates) >= len(CHILDREN)
    reads = [c for c in ours[:creates[-1]] if c["verb"] == "get"]
    assert reads == [], "a new job's children were read before they were made"


# ------------------------------------------------------------------ the keys


def test_the_keys_secret_is_made_once_recorded_and_never_rotated(operator: Operator, api: Api, kubectl: Kubectl,
                                                                 namespace: str) -> None:
    apply(kubectl, namespace, new_job("keys"))
    secret = api.wait("v1/secrets", namespace, "keys-keys")
    assert secret["immutable"] is True and secret["type"] == "Opaque"
    files = {name: base64.b64decode(value).decode() for name, value in secret["data"].items()}
    assert sorted(files) == sorted(keys.FILES)
    made = keys.JobKeys(server_public=files[keys.SERVER_PUBLIC].strip().encode(),
                        server_secret=files[keys.SERVER_SECRET].strip().encode(),
                        client_public=files[keys.CLIENT_PUBLIC].strip().encode(),
                        client_secret=files[keys.CLIENT_SECRET].strip().encode(),
                        chief_public=files[keys.CHIEF_PUBLIC].strip().encode(),
                        chief_secret=files[keys.CHIEF_SECRET].strip().encode())
    made._check_pairs("the Secret")  # real, matching Curve keypairs
    job = api.wait(JOBS, namespace, "keys",
                   lambda j: "distbelief.io/keys-secret-uid" in (j["metadata"].get("annotations") or {}))
    assert job["metadata"]["annotations"]["distbelief.io/keys-secret-uid"] == secret["metadata"]["uid"]
    volumes = {v["name"]: v for v in api.wait(STS, namespace, "keys-ps")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["keys"]["secret"]["secretName"] == "keys-keys"
    api.wait_event(namespace, "keys", "KeysCreated")
    patch_job(kubectl, namespace, "keys", {"spec": {"image": "example.org/distbelief:2"}})  # reconciles again
    api.wait(DEPLOY, namespace, "keys-worker",
             lambda d: d["spec"]["template"]["spec"]["containers"][0]["image"] == "example.org/distbelief:2")
    assert api.get("v1/secrets", namespace, "keys-keys")["data"] == secret["data"]
    assert [e["reason"] for e in api.events(namespace, "keys")].count("KeysCreated") == 1


def test_a_foreign_keys_secret_is_refused(operator: Operator, api: Api, kubectl: Kubectl, namespace: str) -> None:
    planted = keys.JobKeys.generate().files()
    api.create("v1/secrets", namespace, {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "planted-keys", "labels": {
            "distbelief.io/job": "planted"}},
        "data": {n: base64.b64encode(t.encode()).decode() for n, t in planted.items()}})
    apply(kubectl, namespace, new_job("planted"))
    warning = api.wait_event(namespace, "planted", "KeysSecretForeign")
    assert warning["type"] == "Warning"
    time.sleep(1.0)  # the handler has given up; nothing may follow the refusal
    for resource, pattern in CHILDREN[1:]:
        assert api.get(resource, namespace, pattern.format("planted")) is None, resource
    assert "KeysCreated" not in {e["reason"] for e in api.events(namespace, "planted")}
    job = api.get(JOBS, namespace, "planted")
    assert "distbelief.io/keys-secret-uid" not in (job["metadata"].get("annotations") or {})


# ------------------------------------------------------------------ status


def test_status_follows_the_children_and_the_chief(operator: Operator, api: Api, kubectl: Kubectl,
                                                   chiefs: Chiefs, namespace: str) -> None:
    apply(kubectl, namespace, new_job("status"))
    job = api.wait(JOBS, namespace, "status", phase_is("Pending"))
    assert job["status"]["parameterServers"] == {"shards": 2, "ready": 0}
    pods_of(api, namespace, "status", 2, "ps")
    pods_of(api, namespace, "status", 3, "worker")
    kubelet_runs(api, namespace, "status")
    shard, chief = chiefs.of(namespace, "status")
    shard.global_step.set(1234)
    shard.examples_per_second.set(5000)
    chief.accuracy.set(0.93)
    chief.loss.set(0.25)
    job = api.wait(JOBS, namespace, "status", lambda j: phase_is("Running")(j) and j["status"].get("globalStep") == 1234
                   and j["status"]["workers"]["ready"] == 3)
    status = job["status"]
    assert (status["accuracy"], status["loss"], status["examplesPerSecond"]) == (0.93, 0.25, 5000)
    assert status["workers"] == {"replicas": 3, "ready": 3}
    assert status["parameterServers"] == {"shards": 2, "ready": 2}
    assert status["observedGeneration"] == job["metadata"]["generation"]
    for item in status["conditions"]:  # the metav1.Condition shape, which the CRD's status schema requires
        assert set(item) == {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
        assert item["observedGeneration"] == job["metadata"]["generation"]
    assert status["selector"] == "distbelief.io/job=status,distbelief.io/role=worker"
    api.wait_event(namespace, "status", "Running")
    table = kubectl("get", "dbj", "status", "-n", namespace)
    assert "Running" in table and "1234" in table


# ------------------------------------------------------------------ scale


def test_scale_and_autoscaling_go_through_the_spec(operator: Operator, api: Api, kubectl: Kubectl,
                                                   namespace: str) -> None:
    apply(kubectl, namespace, new_job("scale"))
    api.wait(DEPLOY, namespace, "scale-worker")
    kubectl("scale", "dbj/scale", "--replicas=5", "-n", namespace)
    assert api.get(JOBS, namespace, "scale")["spec"]["workers"]["replicas"] == 5
    api.wait(DEPLOY, namespace, "scale-worker", replicas_are(5))
    scale = api.request("GET", api.path(JOBS, namespace, "scale", "scale"))
    assert scale["spec"]["replicas"] == 5
    api.wait(JOBS, namespace, "scale", lambda j: (j.get("status") or {}).get("workers", {}).get("replicas") == 5)
    scale = api.request("GET", api.path(JOBS, namespace, "scale", "scale"))
    assert (scale["status"]["replicas"], scale["status"]["selector"]) == (
        5, "distbelief.io/job=scale,distbelief.io/role=worker")
    scaled = api.wait_event(namespace, "scale", "WorkersScaled")
    assert (scaled["type"], scaled["message"]) == ("Normal", "model replicas 3 -> 5")
    patch_job(kubectl, namespace, "scale", {"spec": {"workers": {"autoscaling": {"minReplicas": 2, "maxReplicas": 6}}}})
    hpas = "autoscaling/v2/horizontalpodautoscalers"
    hpa = api.wait(hpas, namespace, "scale-worker")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "distbelief.io/v1alpha1", "kind": "DistBeliefJob",
                                             "name": "scale"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    patch_job(kubectl, namespace, "scale", {"spec": {"workers": {"autoscaling": {"maxReplicas": 7}}}})
    api.wait(hpas, namespace, "scale-worker", lambda h: h and h["spec"]["maxReplicas"] == 7)
    patch_job(kubectl, namespace, "scale", {"spec": {"workers": {"autoscaling": None}}})
    api.wait(hpas, namespace, "scale-worker", lambda h: h is None)


def test_spec_updates_roll_out_and_a_reshard_of_a_sandblaster_job_is_refused(
        operator: Operator, api: Api, kubectl: Kubectl, namespace: str) -> None:
    doc = load_example("digits-sandblaster.yaml")
    doc["metadata"]["name"] = "update"
    apply(kubectl, namespace, doc)
    api.wait(STS, namespace, "update-ps")
    patch_job(kubectl, namespace, "update", {"spec": {"image": "example.org/distbelief:2"}})

    def image_is(obj: Any) -> bool:
        return obj and obj["spec"]["template"]["spec"]["containers"][0]["image"] == "example.org/distbelief:2"

    api.wait(STS, namespace, "update-ps", image_is)
    api.wait(DEPLOY, namespace, "update-worker", image_is)
    patch_job(kubectl, namespace, "update", {"spec": {"parameterServers": {"shards": 3}}})
    job = api.wait(JOBS, namespace, "update", condition_holds("ShardCountLocked"))
    assert "from 2 to 3: resharding a Sandblaster job is not supported" in condition(job, "ShardCountLocked")["message"]
    assert api.get(STS, namespace, "update-ps")["spec"]["replicas"] == 2
    assert api.wait_event(namespace, "update", "ShardCountLocked")["type"] == "Warning"


# ------------------------------------------------------------------ reshard

BATCH_JOBS = "batch/v1/jobs"


def resharding_reason(reason: str) -> Any:
    return lambda job: job and any(c["type"] == "Resharding" and c["reason"] == reason
                                   for c in (job.get("status") or {}).get("conditions", []))


def test_a_changed_shard_count_stops_the_pods_runs_the_reshard_job_and_resumes_on_the_new_count(
        operator: Operator, api: Api, kubectl: Kubectl, namespace: str) -> None:
    """The operator's side of a reshard (the Job's own is tests/cluster/test_cluster_node.py):
    held, a Job over every claim of either count, and the new count once it succeeded, with
    the operator restarted while the Job runs."""
    apply(kubectl, namespace, new_job("grow"))
    pods_of(api, namespace, "grow", 2, "ps")
    patch_job(kubectl, namespace, "grow", {"spec": {"parameterServers": {"shards": 3}}})
    api.wait(STS, namespace, "grow-ps", replicas_are(0))
    api.wait(DEPLOY, namespace, "grow-worker", replicas_are(0))
    reshard = api.wait(BATCH_JOBS, namespace, "grow-reshard")
    assert controller_of(reshard)["name"] == "grow"
    labels = reshard["metadata"]["labels"]
    assert (labels["distbelief.io/reshard-from"], labels["distbelief.io/reshard-to"]) == ("2", "3")
    pod = reshard["spec"]["template"]["spec"]
    assert [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v] == [
        "checkpoints-grow-ps-0", "checkpoints-grow-ps-1", "checkpoints-grow-ps-2"]
    assert pod["containers"][0]["args"][-4:-2] == ["--shards", "3"]
    claims = {c["metadata"]["name"] for c in api.list("v1/persistentvolumeclaims", namespace)}
    assert {"checkpoints-grow-ps-0", "checkpoints-grow-ps-1", "checkpoints-grow-ps-2"} <= claims
    job = api.wait(JOBS, namespace, "grow", resharding_reason("Resharding"))
    assert job["status"]["phase"] == "Pending" and job["metadata"]["annotations"]["distbelief.io/resharding-to"] == "3"
    assert job["metadata"]["annotations"]["distbelief.io/shards"] == "2"
    api.wait_event(namespace, "grow", "Resharding")

    operator.restart()   # the Job's labels and the job's annotations carry the reshard over
    reshard_pod_ends(api, namespace, "grow", 0, "resharded from 2 to 3 shards at step 420")
    job = api.wait(JOBS, namespace, "grow", resharding_reason("Resharded"))
    assert condition(job, "Resharding")["message"] == "resharded from 2 to 3 shards at step 420"
    assert job["metadata"]["annotations"]["distbelief.io/shards"] == "3"
    assert "distbelief.io/resharding-to" not in job["metadata"]["annotations"]
    api.wait(STS, namespace, "grow-ps", replicas_are(3))
    api.wait(DEPLOY, namespace, "grow-worker", replicas_are(3))
    api.wait(BATCH_JOBS, namespace, "grow-reshard", lambda j: j is None)
    assert api.wait_event(namespace, "grow", "Resharded")["type"] == "Normal"
    assert "ShardCountLocked" not in {c["type"] for c in job["status"]["conditions"]}


def test_a_suspended_job_is_resharded_at_once_and_stays_suspended(operator: Operator, api: Api, kubectl: Kubectl,
                                                                   namespace: str) -> None:
    """Also: a status pass that reads the job as it was before the reshard's end was recorded
    (the operator's watch can lag its own changes) runs no reshard again; and one that reads
    the new count with the status from before still says how the reshard ended."""
    apply(kubectl, namespace, new_job("idle", runPolicy={"suspend": True}))
    api.wait(STS, namespace, "idle-ps", replicas_are(0))
    patch_job(kubectl, namespace, "idle", {"spec": {"parameterServers": {"shards": 4}}})
    reshard = api.wait(BATCH_JOBS, namespace, "idle-reshard")
    assert reshard["metadata"]["labels"]["distbelief.io/reshard-to"] == "4"
    before_the_end = api.get(JOBS, namespace, "idle")
    reshard_pod_ends(api, namespace, "idle", 0, "resharded from 2 to 4 shards at step 12")
    job = api.wait(JOBS, namespace, "idle", resharding_reason("Resharded"))
    assert job["metadata"]["annotations"]["distbelief.io/shards"] == "4" and job["status"]["phase"] == "Suspended"
    api.wait(BATCH_JOBS, namespace, "idle-reshard", lambda j: j is None)

    stale = locks.locked_job(job_spec.validate_job({k: before_the_end[k] for k in ("apiVersion", "kind", "metadata",
                                                                                 "spec")}))
    assert stale.reshard == locks.ShardChange(2, 4)
    as_operator = Kube(kube_config.new_client_from_config(str(operator.kubeconfig)))
    assert resharding.follow(as_operator, stale, [], "unused:image") is None
    assert api.get(BATCH_JOBS, namespace, "idle-reshard") is None
    assert "distbelief.io/resharding-to" not in api.get(JOBS, namespace, "idle")["metadata"]["annotations"]

    ended = condition(job, "Resharding")
    assert (ended["status"], ended["message"]) == ("False", "resharded from 2 to 4 shards at step 12")
    assert job["metadata"]["annotations"]["distbelief.io/resharded"] == ended["message"]
    running = {**ended, "status": "True", "reason": "Resharding",
               "message": "resharding from 2 to 4 shards: Job idle-reshard completed"}
    api.patch(JOBS, namespace, "idle", {"status": {"conditions": [
        c if c["type"] != "Resharding" else running for c in job["status"]["conditions"]]}}, subresource="status")
    job = api.wait(JOBS, namespace, "idle", lambda j: condition(j, "Resharding")["status"] == "False")
    assert condition(job, "Resharding")["message"] == "resharded from 2 to 4 shards at step 12"
    assert api.get(STS, namespace, "idle-ps")["spec"]["replicas"] == 0
    patch_job(kubectl, namespace, "idle", {"spec": {"runPolicy": {"suspend": False}}})
    api.wait(STS, namespace, "idle-ps", replicas_are(4))


def test_a_reshard_pod_the_scheduler_leaves_pending_is_said_in_the_condition(
        operator: Operator, api: Api, kubectl: Kubectl, namespace: str, control_plane: ControlPlane) -> None:
    """Here no node can take the pod (its claims stay unbound: no provisioner), as where the
    claims are local volumes pinned to different nodes."""
    if not control_plane.has("kube-scheduler"):
        unavailable(f"the scheduler's verdict needs kube-scheduler beside the API server in {control_plane.bin}")
    apply(kubectl, namespace, new_job("unplaced", runPolicy={"suspend": True}))
    api.wait(STS, namespace, "unplaced-ps", replicas_are(0))
    patch_job(kubectl, namespace, "unplaced", {"spec": {"parameterServers": {"shards": 3}}})

    def said(job: Any) -> bool:
        return bool(job) and resharding_reason("Resharding")(job) and \
            "cannot be scheduled" in condition(job, "Resharding")["message"]

    message = condition(api.wait(JOBS, namespace, "unplaced", said), "Resharding")["message"]
    assert message.startswith("resharding from 2 to 3 shards: Job unplaced-reshard runs; its pod cannot be "
                              "scheduled (") and message.endswith("so they must be reachable from one node"), message
    api.delete(JOBS, namespace, "unplaced")


@pytest.mark.parametrize("step", resharding.STEPS)
def test_an_operator_killed_at_any_step_of_a_reshard_is_followed_by_the_next_one(
        step: str, operator: Operator, api: Api, kubectl: Kubectl, namespace: str) -> None:
    """SIGKILL just after each change a reshard makes to the cluster; the operator started
    again finishes it (running another Job where the last one's end was not recorded): the
    job on 3 shards, no Job left, nothing half done, and the step the claims were re-laid at
    said, though a Job run again finds them laid already and says only that."""
    name = f"at-{step}"
    apply(kubectl, namespace, new_job(name))
    pods_of(api, namespace, name, 2, "ps")
    operator.extra_env[resharding.KILL_AT_ENV] = step
    laid = resharding.STEPS.index(step) > resharding.STEPS.index("job-created")
    try:
        operator.restart()
        patch_job(kubectl, namespace, name, {"spec": {"parameterServers": {"shards": 3}}})
        if laid:
            reshard_pod_ends(api, namespace, name, 0, "resharded from 2 to 3 shards at step 7")
        assert operator.process is not None
        eventually(lambda: operator.process.poll() is not None, 60, interval=0.2, what=f"the operator killed at {step}")
        assert operator.process.returncode == -signal.SIGKILL
    finally:
        operator.extra_env.pop(resharding.KILL_AT_ENV)
        operator.start()

    def resharded() -> Any:   # the kubelet's part: every reshard pod the Jobs make runs and succeeds
        for _ in pending_reshard_pods(api, namespace, name):
            reshard_pod_ends(api, namespace, name, 0, "already laid over 3 shards, at step 7" if laid
                             else "resharded from 2 to 3 shards at step 7")
        job = api.get(JOBS, namespace, name)
        return job if resharding_reason("Resharded")(job) and \
            "distbelief.io/resharding-to" not in job["metadata"]["annotations"] else None

    job = eventually(resharded, 90, interval=0.5, what=f"the reshard finished after a kill at {step}")
    assert job["metadata"]["annotations"]["distbelief.io/shards"] == "3"
    assert condition(job, "Resharding")["message"] == "resharded from 2 to 3 shards at step 7", step
    api.wait(STS, namespace, f"{name}-ps", replicas_are(3))
    api.wait(DEPLOY, namespace, f"{name}-worker", replicas_are(3))
    api.wait(BATCH_JOBS, namespace, f"{name}-reshard", lambda j: j is None)
    api.delete(JOBS, namespace, name)


def test_a_failed_reshard_keeps_the_job_stopped_on_its_count_until_the_count_is_set_back(
        operator: Operator, api: Api, kubectl: Kubectl, namespace: str) -> None:
    apply(kubectl, namespace, new_job("shrink"))
    pods_of(api, namespace, "shrink", 2, "ps")
    patch_job(kubectl, namespace, "shrink", {"spec": {"parameterServers": {"shards": 1}}})
    for _ in range(3):    # the Job's backoffLimit is 2: three pods fail
        reshard_pod_ends(api, namespace, "shrink", 2, "error: shard 1 has no checkpoint that verifies in /x")
    job = api.wait(JOBS, namespace, "shrink", resharding_reason("ReshardFailed"))
    failed = condition(job, "Resharding")
    assert failed["status"] == "False" and "shard 1 has no checkpoint that verifies" in failed["message"]
    assert "the job keeps 2 shards" in failed["message"] and job["status"]["phase"] == "Pending"
    assert api.wait_event(namespace, "shrink", "ReshardFailed")["type"] == "Warning"
    assert api.get(STS, namespace, "shrink-ps")["spec"]["replicas"] == 0
    # Set back: a reshard to 2, which finishes or undoes what the failed one left.
    patch_job(kubectl, namespace, "shrink", {"spec": {"parameterServers": {"shards": 2}}})
    api.wait(BATCH_JOBS, namespace, "shrink-reshard",
             lambda j: j and j["metadata"]["labels"]["distbelief.io/reshard-to"] == "2")
    reshard_pod_ends(api, namespace, "shrink", 0, "already laid over 2 shards, at step 7")
    job = api.wait(JOBS, namespace, "shrink", resharding_reason("Resharded"))
    assert job["metadata"]["annotations"]["distbelief.io/shards"] == "2"
    api.wait(STS, namespace, "shrink-ps", replicas_are(2))


def test_a_count_changed_while_the_reshard_job_runs_records_what_it_did_then_reshards_again(
        operator: Operator, api: Api, kubectl: Kubectl, namespace: str) -> None:
    """2 -> 3, then 4 while the Job to 3 runs: its end is recorded with its outcome (the job
    would read it if set back to 3 before the next pass), and a Job from 3 to 4 follows."""
    apply(kubectl, namespace, new_job("moved"))
    pods_of(api, namespace, "moved", 2, "ps")
    patch_job(kubectl, namespace, "moved", {"spec": {"parameterServers": {"shards": 3}}})
    api.wait(BATCH_JOBS, namespace, "moved-reshard")
    patch_job(kubectl, namespace, "moved", {"spec": {"parameterServers": {"shards": 4}}})
    reshard_pod_ends(api, namespace, "moved", 0, "resharded from 2 to 3 shards at step 420")
    job = api.wait(JOBS, namespace, "moved", lambda j: j["metadata"]["annotations"].get("distbelief.io/shards") == "3")
    annotations = job["metadata"]["annotations"]
    assert annotations["distbelief.io/resharded"] == "resharded from 2 to 3 shards at step 420", annotations
    assert annotations["distbelief.io/resharding-to"] == "4", annotations
    api.wait(BATCH_JOBS, namespace, "moved-reshard", lambda j: j and j["metadata"]["labels"]["distbelief.io/reshard-to"] == "4"
             and j["metadata"]["labels"]["distbelief.io/reshard-from"] == "3")
    reshard_pod_ends(api, namespace, "moved", 0, "resharded from 3 to 4 shards at step 420")
    job = api.wait(JOBS, namespace, "moved", resharding_reason("Resharded"))
    assert condition(job, "Resharding")["message"] == "resharded from 3 to 4 shards at step 420"
    api.wait(STS, namespace, "moved-ps", replicas_are(4))


def test_an_operator_with_another_default_image_leaves_running_jobs_on_theirs(operator: Operator, api: Api,
                                                                             kubectl: Kubectl, namespace: str) -> None:
    """An upgrade of the operator (a new runtime image by default) restarts no running job:
    each keeps the image recorded at its creation; new jobs get the new one."""
    apply(kubectl, namespace, new_job("pinned"))
    before = api.wait(STS, namespace, "pinned-ps")
    image = before["spec"]["template"]["spec"]["containers"][0]["image"]
    job = api.wait(JOBS, namespace, "pinned", lambda j: "distbelief.io/runtime-image" in j["metadata"]["annotations"])
    assert job["metadata"]["annotations"]["distbelief.io/runtime-image"] == image
    operator.extra_env["DISTBELIEF_RUNTIME_IMAGE"] = "example.org/distbelief:next"
    try:
        operator.restart()
        apply(kubectl, namespace, new_job("fresh"))
        fresh = api.wait(STS, namespace, "fresh-ps")
        assert fresh["spec"]["template"]["spec"]["containers"][0]["image"] == "example.org/distbelief:next"
        kubectl("scale", "dbj/pinned", "--replicas=4", "-n", namespace)   # the new operator reconciles it
        worker = api.wait(DEPLOY, namespace, "pinned-worker", replicas_are(4))
        assert worker["spec"]["template"]["spec"]["containers"][0]["image"] == image
        after = api.get(STS, namespace, "pinned-ps")
        assert (after["metadata"]["generation"], after["spec"]["template"]["spec"]["containers"][0]["image"]) == (
            before["metadata"]["generation"], image)
    finally:
        operator.extra_env.pop("DISTBELIEF_RUNTIME_IMAGE")
        operator.restart()


def test_a_partitioned_job_scales_every_partition_and_keeps_its_partition_count(
        operator: Operator, api: Api, kubectl: Kubectl, namespace: str) -> None:
    doc = copy.deepcopy(load_example("digits-partitioned.yaml"))
    doc["metadata"]["name"] = "parts"
    apply(kubectl, namespace, doc)
    partitions = ["parts-worker-p0", "parts-worker-p1"]
    for name in partitions:
        deployment = api.wait(DEPLOY, namespace, name)
        assert deployment["spec"]["replicas"] == 3
        assert deployment["spec"]["selector"]["matchLabels"]["distbelief.io/partition"] == name[-1]
    assert api.get(DEPLOY, namespace, "parts-worker") is None
    job = api.wait(JOBS, namespace, "parts",
                   lambda j: "distbelief.io/partitions" in (j["metadata"].get("annotations") or {}))
    assert job["metadata"]["annotations"]["distbelief.io/partitions"] == "2"
    # A replica is one pod of each partition: the status counts the partition with the fewest.
    pods_of(api, namespace, "parts", 2, "ps")
    pods_of(api, namespace, "parts", 6, "worker")
    kubelet_runs(api, namespace, "parts", role="ps")
    p1 = api.list("v1/pods", namespace, "distbelief.io/job=parts,distbelief.io/partition=1")
    for pod in api.list("v1/pods", namespace, "distbelief.io/job=parts,distbelief.io/partition=0") + p1[:1]:
        api.patch("v1/pods", namespace, pod["metadata"]["name"], {"status": {
            "phase": "Running", "conditions": READY}}, subresource="status")
    job = api.wait(JOBS, namespace, "parts", lambda j: phase_is("Running")(j)
                   and j["status"]["workers"] == {"replicas": 3, "ready": 1})
    kubectl("scale", "dbj/parts", "--replicas=5", "-n", namespace)
    for name in partitions:
        api.wait(DEPLOY, namespace, name, replicas_are(5))
    patch_job(kubectl, namespace, "parts", {"spec": {"model": {"partitions": 1}}})
    job = api.wait(JOBS, namespace, "parts", condition_holds("PartitionCountLocked"))
    assert condition(job, "PartitionCountLocked")["message"].startswith(
        "spec.model.partitions changed from 2 to 1: repartitioning a job is not supported")
    api.wait_event(namespace, "parts", "PartitionCountLocked")
    assert api.get(DEPLOY, namespace, "parts-worker") is None
    assert all(api.get(DEPLOY, namespace, name)["spec"]["replicas"] == 5 for name in partitions)


# ------------------------------------------------------------------ suspend, finish, fail


def test_suspend_scales_to_zero_and_resume_comes_back(operator: Operator, api: Api, kubectl: Kubectl,
                                                      namespace: str) -> None:
    apply(kubectl, namespace, new_job("pause"))
    pods_of(api, namespace, "pause", 3, "worker")
    api.wait(JOBS, namespace, "pause", phase_is("Pending"))
    patch_job(kubectl, namespace, "pause", {"spec": {"runPolicy": {"suspend": True}}})
    api.wait(STS, namespace, "pause-ps", replicas_are(0))
    api.wait(DEPLOY, namespace, "pause-worker", replicas_are(0))
    api.wait(JOBS, namespace, "pause", phase_is("Suspended"))
    api.wait_event(namespace, "pause", "Suspended")
    # The controllers take the pods away; the checkpoint claims stay.
    eventually(lambda: not api.list("v1/pods", namespace, "distbelief.io/job=pause"), 45, interval=0.2,
               what="the suspended job's pods gone")
    assert len(api.list("v1/persistentvolumeclaims", namespace)) == 2
    patch_job(kubectl, namespace, "pause", {"spec": {"runPolicy": {"suspend": False}}})
    api.wait(STS, namespace, "pause-ps", replicas_are(2))
    api.wait(DEPLOY, namespace, "pause-worker", replicas_are(3))
    api.wait(JOBS, namespace, "pause", phase_is("Pending"))
    # An Event for every phase change, in order.
    eventually(lambda: [e["reason"] for e in api.events(namespace, "pause") if e["reason"] in
                        ("Pending", "Running", "Suspended")] == ["Pending", "Suspended", "Pending"], 45, interval=0.2,
               what="the Events Pending, Suspended, Pending in order")


def test_completion_succeeds_and_scales_down(operator: Operator, api: Api, kubectl: Kubectl, chiefs: Chiefs,
                                             namespace: str) -> None:
    apply(kubectl, namespace, new_job("finish"))
    pods_of(api, namespace, "finish", 3, "worker")
    kubelet_runs(api, namespace, "finish")
    shard, chief = chiefs.of(namespace, "finish")
    shard.global_step.set(8000)
    chief.accuracy.set(0.98)
    chief.finished.labels(reason="MaxStepsReached", outcome="Succeeded").set(1)
    job = api.wait(JOBS, namespace, "finish", phase_is("Succeeded"))
    assert job["status"]["completionTime"]
    assert condition(job, "Succeeded")["reason"] == "MaxStepsReached"
    api.wait(DEPLOY, namespace, "finish-worker", replicas_are(0))
    api.wait(STS, namespace, "finish-ps", replicas_are(0))
    api.wait_event(namespace, "finish", "MaxStepsReached")
    # A later spec change does not revive a finished job.
    patch_job(kubectl, namespace, "finish", {"spec": {"workers": {"replicas": 4}}})
    time.sleep(3)  # time for the operator to (wrongly) act; the assertion is on state, not time
    assert api.get(DEPLOY, namespace, "finish-worker")["spec"]["replicas"] == 0


def test_every_shard_restart_and_failover_is_a_warning_event(operator: Operator, api: Api, kubectl: Kubectl,
                                                              chiefs: Chiefs, namespace: str) -> None:
    apply(kubectl, namespace, new_job("events"))
    pods_of(api, namespace, "events", 2, "ps")
    pods_of(api, namespace, "events", 3, "worker")
    kubelet_runs(api, namespace, "events")
    shard, chief = chiefs.of(namespace, "events")
    shard.global_step.set(10)
    for index in (0, 1):
        chief.shard_copies.labels(shard=str(index)).set(2)
        chief.shard_primary.labels(shard=str(index)).set(0)
        chief.shard_failovers.labels(shard=str(index)).set(0)
    api.wait(JOBS, namespace, "events", lambda j: phase_is("Running")(j) and "shards" in j["status"])
    (pod, *_) = kubelet_runs(api, namespace, "events", role="ps", container_status={
        "restartCount": 1, "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}})
    restarted = api.wait_event(namespace, "events", "ShardRestarted")
    assert restarted["type"] == "Warning" and restarted["message"].startswith(f"{pod} last exited with code 137")
    chief.shard_primary.labels(shard="1").set(1)
    chief.shard_failovers.labels(shard="1").set(1)
    failover = api.wait_event(namespace, "events", "ShardFailover")
    assert failover["message"].startswith("shard 1: events-ps-3 took over from events-ps-1"), failover["message"]


def test_a_crash_looping_shard_fails_the_job(operator: Operator, api: Api, kubectl: Kubectl, namespace: str) -> None:
    apply(kubectl, namespace, new_job("crash"))
    pods_of(api, namespace, "crash", 2, "ps")
    kubelet_runs(api, namespace, "crash", role="ps", container_status={
        "restartCount": 4, "ready": False, "started": False, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": "error: boom"}}})
    job = api.wait(JOBS, namespace, "crash", phase_is("Failed"))
    failed = condition(job, "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "last exited with code 1: error: boom" in failed["message"]
    api.wait(DEPLOY, namespace, "crash-worker", replicas_are(0))
    assert api.wait_event(namespace, "crash", "BackoffLimitExceeded")["type"] == "Warning"


def test_a_config_error_in_a_pod_fails_the_job_as_invalid_config(operator: Operator, api: Api, kubectl: Kubectl,
                                                                 namespace: str) -> None:
    apply(kubectl, namespace, new_job("badcfg"))
    pods_of(api, namespace, "badcfg", 3, "worker")
    (pod, *_) = kubelet_runs(api, namespace, "badcfg", role="worker", container_status={
        "ready": False, "started": False,
        "state": {"terminated": {"exitCode": 2, "message": "error: npz:/data/d.npz: labels skip 2..6"}}})
    job = api.wait(JOBS, namespace, "badcfg", phase_is("Failed"))
    failed = condition(job, "Failed")
    assert failed["reason"] == "InvalidConfig"
    assert failed["message"].endswith(": error: npz:/data/d.npz: labels skip 2..6")
    api.wait(STS, namespace, "badcfg-ps", replicas_are(0))


def test_a_model_too_large_for_its_pods_gets_a_warning_event(operator: Operator, api: Api, kubectl: Kubectl,
                                                             namespace: str) -> None:
    apply(kubectl, namespace, new_job("huge", model={"hiddenLayers": [65536, 65536, 65536]}))
    warning = api.wait_event(namespace, "huge", "MemoryLimitLow")
    assert warning["type"] == "Warning" and "is likely too small" in warning["message"]
    api.wait(STS, namespace, "huge-ps")  # a warning, not a refusal


# ------------------------------------------------------------------ delete


def test_deleting_the_job_takes_its_children_and_keeps_the_checkpoints(operator: Operator, api: Api,
                                                                       kubectl: Kubectl, namespace: str) -> None:
    apply(kubectl, namespace, new_job("gone"))
    pods_of(api, namespace, "gone", 2, "ps")
    kubectl("delete", "dbj", "gone", "-n", namespace, "--wait=true", timeout=90)
    for resource, pattern in CHILDREN:  # the garbage collector follows the owner references
        api.wait(resource, namespace, pattern.format("gone"), lambda o: o is None)
    eventually(lambda: not api.list("v1/pods", namespace, "distbelief.io/job=gone"), 45, interval=0.2,
               what="the deleted job's pods gone")
    assert len(api.list("v1/persistentvolumeclaims", namespace, "distbelief.io/job=gone")) == 2  # retention: Retain


def test_ttl_deletes_a_finished_job_and_its_children(operator: Operator, api: Api, kubectl: Kubectl, chiefs: Chiefs,
                                                     namespace: str) -> None:
    apply(kubectl, namespace, new_job("ttl", runPolicy={"ttlSecondsAfterFinished": 1},
                                      parameterServers={"checkpoint": {"storage": {"retention": "Delete"}}}))
    api.wait("v1/configmaps", namespace, "ttl-config")
    pods_of(api, namespace, "ttl", 2, "ps")
    _, chief = chiefs.of(namespace, "ttl")
    chief.finished.labels(reason="TargetAccuracyReached", outcome="Succeeded").set(1)
    api.wait(JOBS, namespace, "ttl", lambda j: j is None)
    for resource, pattern in CHILDREN:
        api.wait(resource, namespace, pattern.format("ttl"), lambda o: o is None)
    eventually(lambda: not api.list("v1/persistentvolumeclaims", namespace, "distbelief.io/job=ttl"), 45,
               interval=0.2, what="the claims of a job with retention Delete gone")


# ------------------------------------------------------------------ refused at the API


def test_an_invalid_job_is_refused_by_the_api_naming_the_field(kubectl: Kubectl, chart: str, namespace: str) -> None:
    done = kubectl.run("apply", "-n", namespace, "-f", "-",
                       input=yaml.safe_dump(new_job("invalid", training={"batchSize": 0})))
    assert done.returncode != 0
    assert "spec.training.batchSize" in done.stderr


def test_a_crd_newer_than_the_operator_fails_no_job(operator: Operator, api: Api, kubectl: Kubectl,
                                                    namespace: str) -> None:
    """The CRD upgraded before the operator: its new defaulted field is in every job the
    API server returns; the operator ignores it (and says so) instead of failing the job."""
    path = "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/training/properties/futureKnob"
    kubectl("patch", "crd", CRD_NAME, "--type=json", "-p", json.dumps(
        [{"op": "add", "path": path, "value": {"type": "boolean", "default": False}}]))
    try:
        eventually(lambda: "futureKnob" in kubectl("get", "crd", CRD_NAME, "-o", "json"), 30, interval=0.5)
        apply(kubectl, namespace, new_job("newer"))
        job = api.wait(JOBS, namespace, "newer", condition_holds("Created"))
        assert job["spec"]["training"]["futureKnob"] is False   # the newer CRD's default
        assert (job.get("status") or {}).get("phase") != "Failed", job.get("status")
        api.wait(DEPLOY, namespace, "newer-worker")
        said = "event=fields_unknown job=newer fields=spec.training.futureKnob"   # once, when the job came: whole log
        assert said in operator.log_path.read_text(errors="replace")
    finally:
        kubectl("patch", "crd", CRD_NAME, "--type=json", "-p", json.dumps([{"op": "remove", "path": path}]))


# ------------------------------------------------------------------ restarts


def test_an_operator_killed_mid_job_picks_up_without_duplicates(operator: Operator, api: Api, kubectl: Kubectl,
                                                                chiefs: Chiefs, namespace: str) -> None:
    apply(kubectl, namespace, new_job("restart"))
    api.wait("v1/configmaps", namespace, "restart-config")  # the first children are being written
    operator.restart(signal.SIGKILL)
    api.wait(DEPLOY, namespace, "restart-worker")
    api.wait(JOBS, namespace, "restart", phase_is("Pending"))
    pods_of(api, namespace, "restart", 3, "worker")
    kubelet_runs(api, namespace, "restart")
    shard, _ = chiefs.of(namespace, "restart")
    shard.global_step.set(10)
    api.wait(JOBS, namespace, "restart", lambda j: phase_is("Running")(j) and j["status"].get("globalStep") == 10)
    api.wait_event(namespace, "restart", "Running")  # kopf posts Events from a queue a kill would lose
    operator.restart(signal.SIGKILL)  # while it runs: the job goes on where it was
    shard.global_step.set(20)
    job = api.wait(JOBS, namespace, "restart", lambda j: j["status"].get("globalStep") == 20)
    assert job["status"]["phase"] == "Running"
    for resource, _ in CHILDREN:
        assert len(api.list(resource, namespace, "distbelief.io/job=restart")) == 1, resource
    assert [e["reason"] for e in api.events(namespace, "restart")].count("Running") == 1


def test_a_missing_peering_object_is_warned_about_then_and_again(
        control_plane: Any, kubectl: Kubectl, chart: str, namespace: str, tmp_path: Any) -> None:
    """A developer's operator, for one namespace, with peering: kopf pauses it silently while
    the KopfPeering is missing; the operator warns at once and again, and stops once it is there."""
    log_path = tmp_path / "operator.log"
    env = control_plane.env(DISTBELIEF_PEERING_CHECK_SECONDS="1")
    with open(log_path, "ab") as log:
        process = subprocess.Popen([str(Path(sys.executable).parent / "distbelief"), "operator", "--namespace",
                                    namespace, "--liveness", ""], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        eventually(lambda: log_path.read_text().count("event=peering_missing") >= 2, 45, interval=0.2,
                   what="two warnings of the missing peering object")
        warnings = [line for line in log_path.read_text().splitlines() if "event=peering_missing" in line]
        kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
            "apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "distbelief"}}))
        time.sleep(1.5)  # one check may have been under way
        settled = log_path.read_text().count("event=peering_missing")
        time.sleep(3)  # three more checks: none may warn now
        after = log_path.read_text().count("event=peering_missing") - settled
        failures = log_path.read_text().count("event=peering_check_failed")
    finally:
        stop_process(process)
    assert len(warnings) >= 2, log_path.read_text()[-3000:]
    assert " WARNING " in warnings[0]
    assert f"KopfPeering {namespace}/distbelief" in warnings[0] and "--standalone" in warnings[0]
    assert after == 0 and failures == 0


# ------------------------------------------------------------------ a job re-created under the same name


def claims_of(api: Api, namespace: str, job: str) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in api.list("v1/persistentvolumeclaims", namespace,
                                                       f"distbelief.io/job={job}")}


def test_a_job_re_created_under_the_same_name_never_resumes_the_old_ones_checkpoints(
        operator: Operator, api: Api, kubectl: Kubectl, namespace: str) -> None:
    """retention: Retain keeps a deleted job's checkpoint claims, and the StatefulSet of a new
    job of that name would mount them. The operator refuses to start it, naming the claims,
    until they are gone; then the job starts afresh on claims of its own."""
    first = apply(kubectl, namespace, new_job("again"))
    pods_of(api, namespace, "again", 2, "ps")
    old = claims_of(api, namespace, "again")
    assert len(old) == 2 and {c["metadata"]["labels"]["distbelief.io/job-uid"] for c in old.values()} == {
        first["metadata"]["uid"]}
    kubectl("delete", "dbj", "again", "-n", namespace, "--wait=true", timeout=90)
    api.wait(STS, namespace, "again-ps", lambda o: o is None)
    second = apply(kubectl, namespace, new_job("again"))
    job = api.wait(JOBS, namespace, "again", lambda j: bool((j.get("status") or {}).get("conditions"))
                   and condition(j, "Created")["reason"] == "CheckpointsOfAnotherJob")
    message = condition(job, "Created")["message"]
    assert all(name in message for name in old) and f"kubectl -n {namespace} delete pvc" in message
    assert job["status"]["phase"] == "Pending"
    warning = api.wait_event(namespace, "again", "CheckpointsOfAnotherJob")
    assert warning["type"] == "Warning" and all(name in warning["message"] for name in old)
    for resource, pattern in CHILDREN:  # nothing is made, not even the keys
        assert api.get(resource, namespace, pattern.format("again")) is None, resource
    kubectl("delete", "pvc", *old, "-n", namespace, "--wait=true", timeout=90)
    api.wait(STS, namespace, "again-ps")
    pods_of(api, namespace, "again", 2, "ps")
    api.wait(JOBS, namespace, "again", lambda j: condition(j, "Created")["status"] == "True")
    fresh = claims_of(api, namespace, "again")
    assert {c["metadata"]["labels"]["distbelief.io/job-uid"] for c in fresh.values()} == {second["metadata"]["uid"]}
    # The job's uid reaches the shards (in the config), which record it in their checkpoints.
    config = json.loads(api.get("v1/configmaps", namespace, "again-config")["data"]["job.json"])
    assert config["uid"] == second["metadata"]["uid"]


def test_a_job_made_before_claims_were_labelled_keeps_resuming(operator: Operator, api: Api, kubectl: Kubectl,
                                                               namespace: str) -> None:
    """An upgrade: a job an older operator reconciled (its shard count recorded) has claims
    without the job's uid. They are its own; it is not refused."""
    for ordinal in (0, 1):
        api.create("v1/persistentvolumeclaims", namespace, {
            "metadata": {"name": f"checkpoints-legacy-ps-{ordinal}", "labels": {
                "distbelief.io/job": "legacy", "distbelief.io/role": "ps"}},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    doc = new_job("legacy")
    doc["metadata"]["annotations"] = {"distbelief.io/shards": "2", "distbelief.io/partitions": "1"}
    apply(kubectl, namespace, doc)
    api.wait(STS, namespace, "legacy-ps")
    api.wait(JOBS, namespace, "legacy", lambda j: bool((j.get("status") or {}).get("conditions"))
             and condition(j, "Created")["status"] == "True")
    assert "CheckpointsOfAnotherJob" not in {e["reason"] for e in api.events(namespace, "legacy")}
