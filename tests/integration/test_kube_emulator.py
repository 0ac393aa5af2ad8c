"""The Kubernetes API emulator (tests/kube) that the operator tests run against.

Each test talks to it as a real client would: the official kubernetes Python client
(loaded from the emulator's kubeconfig, never from $KUBECONFIG), plain HTTP, a real
``kopf run`` subprocess and, when tools/fetch-kube-tools has fetched it, kubectl.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.client.rest import ApiException

from kube import KubeEmulator
from kube import objects
from kube.plugin import JOB_CRD, project_emulator
from support.paths import REPO

pytestmark = pytest.mark.timeout(60)

EXAMPLE = REPO / "examples" / "digits-mlp.yaml"
GROUP, VERSION, PLURAL = "distbelief.io", "v1alpha1", "distbeliefjobs"
JOBS = f"{GROUP}/{VERSION}/{PLURAL}"


# ---------------------------------------------------------------------- helpers


@pytest.fixture
def api(kube: KubeEmulator) -> Iterator[kubernetes.client.ApiClient]:
    client = kubernetes.config.new_client_from_config(config_file=str(kube.kubeconfig))
    yield client
    client.close()


def core(api: kubernetes.client.ApiClient) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(api)


def custom(api: kubernetes.client.ApiClient) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(api)


def http(kube: KubeEmulator, method: str, path: str, body: Any = None,
         content_type: str = "application/json", accept: str = "application/json") -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(kube.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type, "Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def watch_lines(kube: KubeEmulator, path: str, count: int, timeout: float = 10) -> list[dict[str, Any]]:
    """Up to ``count`` events of a watch (plain HTTP), bounded by the server-side timeout."""
    sep = "&" if "?" in path else "?"
    url = f"{kube.url}{path}{sep}watch=true&timeoutSeconds={int(timeout)}"
    events = []
    with urllib.request.urlopen(url, timeout=timeout + 5) as response:
        for line in response:
            events.append(json.loads(line))
            if len(events) == count:
                break
    return events


def job(name: str = "digits", **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    return doc


def configmap(name: str, labels: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, **({"labels": labels} if labels else {}), **meta}, "data": {"k": "v"}}


def owner(obj: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": obj["metadata"]["name"],
            "uid": obj["metadata"]["uid"]}


# -------------------------------------------------------------- server metadata


def test_create_assigns_uid_resource_version_generation_and_timestamp(kube, api):
    created = core(api).create_namespaced_config_map("default", configmap("a"))
    meta = created.metadata
    assert len(meta.uid) == 36 and meta.generation == 1 and meta.creation_timestamp is not None
    raw = kube.get("v1/configmaps", "a")
    assert raw["metadata"]["creationTimestamp"].endswith("Z")
    assert objects.parse_time(raw["metadata"]["creationTimestamp"]).tzinfo is not None
    assert meta.resource_version.isdigit()

    second = core(api).create_namespaced_config_map("default", configmap("b"))
    assert int(second.metadata.resource_version) > int(meta.resource_version)  # one global counter
    assert second.metadata.uid != meta.uid

    with pytest.raises(ApiException) as exc:
        core(api).create_namespaced_config_map("default", configmap("a"))
    status = json.loads(exc.value.body)
    assert exc.value.status == 409 and status["kind"] == "Status" and status["reason"] == "AlreadyExists"
    assert status["message"] == 'configmaps "a" already exists'

    generated = core(api).create_namespaced_config_map(
        "default", {"metadata": {"generateName": "job-"}, "data": {}})
    assert generated.metadata.name.startswith("job-") and len(generated.metadata.name) == 9


def test_update_with_a_stale_resource_version_is_a_conflict(kube, api):
    old = core(api).create_namespaced_config_map("default", configmap("a"))
    old.data = {"k": "new"}
    updated = core(api).replace_namespaced_config_map("a", "default", old)
    assert updated.data == {"k": "new"}
    assert int(updated.metadata.resource_version) > int(old.metadata.resource_version)
    with pytest.raises(ApiException) as exc:
        core(api).replace_namespaced_config_map("a", "default", old)  # old resourceVersion
    assert exc.value.status == 409 and json.loads(exc.value.body)["reason"] == "Conflict"


def test_errors_are_status_objects(kube, api):
    with pytest.raises(ApiException) as exc:
        custom(api).get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "nope")
    status = json.loads(exc.value.body)
    assert exc.value.status == 404
    assert status == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 404,
                      "reason": "NotFound", "message": 'distbeliefjobs.distbelief.io "nope" not found',
                      "details": {"name": "nope", "group": GROUP, "kind": PLURAL}}
    assert http(kube, "GET", "/apis/nothing.example/v1/things")[0] == 404


def test_generation_bumps_on_spec_changes_only(kube, api):
    jobs = custom(api)
    created = jobs.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, job())
    assert created["metadata"]["generation"] == 1

    labelled = jobs.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "digits",
                                                   {"metadata": {"labels": {"team": "a"}}})
    assert labelled["metadata"]["generation"] == 1
    status = jobs.patch_namespaced_custom_object_status(GROUP, VERSION, "default", PLURAL, "digits",
                                                        {"status": {"phase": "Running"}})
    assert status["metadata"]["generation"] == 1 and status["status"]["phase"] == "Running"
    changed = jobs.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "digits",
                                                  {"spec": {"training": {"maxSteps": 42}}})
    assert changed["metadata"]["generation"] == 2
    assert int(changed["metadata"]["resourceVersion"]) > int(status["metadata"]["resourceVersion"])

    same = jobs.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "digits",
                                               {"spec": {"training": {"maxSteps": 42}}})
    assert same["metadata"] == changed["metadata"]  # a no-op write changes nothing, not even the rv


# --------------------------------------------------------------------- selectors


def test_list_by_label_and_field_selectors(kube, api):
    for name, labels in (("a", {"app": "x", "tier": "web"}), ("b", {"app": "x"}), ("c", {"app": "y"}), ("d", {})):
        kube.create("v1/configmaps", configmap(name, labels))

    def names(**kwargs: str) -> list[str]:
        return [cm.metadata.name for cm in core(api).list_namespaced_config_map("default", **kwargs).items]

    assert names() == ["a", "b", "c", "d"]
    assert names(label_selector="app=x") == ["a", "b"]
    assert names(label_selector="app=x,tier=web") == ["a"]
    assert names(label_selector="app") == ["a", "b", "c"]
    assert names(label_selector="!app") == ["d"]
    assert names(label_selector="app!=x") == ["c", "d"]
    assert names(label_selector="app in (x, y),tier notin (web)") == ["b", "c"]
    assert names(field_selector="metadata.name=c") == ["c"]
    listing = core(api).list_namespaced_config_map("default")
    assert listing.metadata.resource_version == kube.store.resource_version
    assert kube.list("configmaps", labels={"app": "y"})[0]["metadata"]["name"] == "c"


# ------------------------------------------------------------------------ watch


def test_watch_from_a_resource_version_sends_only_later_events(kube, api):
    kube.create("v1/configmaps", configmap("old-1"))
    kube.create("v1/configmaps", configmap("old-2"))
    since = core(api).list_namespaced_config_map("default").metadata.resource_version
    kube.create("v1/configmaps", configmap("new"))
    kube.patch("v1/configmaps", "old-1", {"data": {"k": "changed"}})
    kube.delete("v1/configmaps", "old-2")

    stream = kubernetes.watch.Watch()
    seen = []
    for event in stream.stream(core(api).list_namespaced_config_map, "default", resource_version=since,
                               timeout_seconds=5, _request_timeout=10):
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == 3:
            stream.stop()
    assert seen == [("ADDED", "new"), ("MODIFIED", "old-1"), ("DELETED", "old-2")]


def test_watch_without_a_resource_version_starts_with_the_existing_objects(kube):
    kube.create("v1/configmaps", configmap("there"))
    first = watch_lines(kube, "/api/v1/namespaces/default/configmaps", count=1)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in first] == [("ADDED", "there")]


def test_watch_streams_live_events_cluster_wide_and_by_selector(kube):
    rv = kube.store.resource_version
    results: list[list[dict[str, Any]]] = []
    reader = threading.Thread(target=lambda: results.append(watch_lines(
        kube, f"/api/v1/configmaps?resourceVersion={rv}&labelSelector=app%3Dx", count=3)))
    reader.start()
    kube.create("v1/configmaps", configmap("other", {"app": "y"}))        # never matches
    kube.create("v1/configmaps", configmap("a", {"app": "x"}), namespace="team-a")
    kube.patch("v1/configmaps", "a", {"metadata": {"labels": {"app": "z"}}}, namespace="team-a")  # leaves
    kube.patch("v1/configmaps", "other", {"metadata": {"labels": {"app": "x"}}})                  # enters
    reader.join(15)
    (events,) = results
    assert [(e["type"], e["object"]["metadata"]["namespace"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "team-a", "a"), ("DELETED", "team-a", "a"), ("ADDED", "default", "other")]


def test_watch_from_a_resource_version_older_than_the_history_is_gone(tmp_path):
    with project_emulator(history=3) as emulator:
        for i in range(5):
            emulator.create("v1/configmaps", configmap(f"cm-{i}"))
        (event,) = watch_lines(emulator, "/api/v1/namespaces/default/configmaps?resourceVersion=1", count=1)
        assert event["type"] == "ERROR" and event["object"]["code"] == 410
        assert event["object"]["reason"] == "Expired"


def test_watch_honours_timeout_seconds(kube):
    with urllib.request.urlopen(f"{kube.url}/api/v1/namespaces/default/configmaps?watch=true&timeoutSeconds=1"
                                f"&resourceVersion={kube.store.resource_version}", timeout=10) as response:
        assert response.read() == b""  # the stream ends by itself, empty


# ------------------------------------------------------------------------ patches


def test_json_patch_test_operation_guards_the_resource_version(kube):
    created = kube.create(JOBS, job())
    path = "/apis/distbelief.io/v1alpha1/namespaces/default/distbeliefjobs/digits"
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
             {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]}]
    code, status = http(kube, "PATCH", path, stale, "application/json-patch+json")
    assert code == 422 and status["kind"] == "Status" and status["reason"] == "Invalid"
    assert "finalizers" not in kube.get(JOBS, "digits")["metadata"]

    fresh = [{**stale[0], "value": created["metadata"]["resourceVersion"]}, stale[1]]
    code, patched = http(kube, "PATCH", path, fresh, "application/json-patch+json")
    assert code == 200 and patched["metadata"]["finalizers"] == ["x/y"]


def test_strategic_merge_patch_merges_containers_by_name(kube, api):
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}}, "template": {
            "metadata": {"labels": {"app": "web"}},
            "spec": {"containers": [{"name": "main", "image": "a:1"}, {"name": "side", "image": "b:1"}]}}}}
    kubernetes.client.AppsV1Api(api).create_namespaced_deployment("default", deployment)
    patch = {"spec": {"template": {"spec": {"containers": [{"name": "main", "image": "a:2"}]}}}}
    code, patched = http(kube, "PATCH", "/apis/apps/v1/namespaces/default/deployments/web", patch,
                         "application/strategic-merge-patch+json")
    assert code == 200
    assert patched["spec"]["template"]["spec"]["containers"] == [{"name": "main", "image": "a:2"},
                                                                  {"name": "side", "image": "b:1"}]
    assert patched["metadata"]["generation"] == 2
    assert objects.strategic_merge_patch({"a": [{"name": "x"}, {"name": "y"}], "b": 1},
                                         {"a": [{"name": "x", "$patch": "delete"}], "$retainKeys": ["a"]}) == {
        "a": [{"name": "y"}]}


# ------------------------------------------------------------------ subresources


def test_status_subresource_isolates_status_from_the_rest(kube, api):
    jobs = custom(api)
    jobs.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, {**job(), "status": {"phase": "Failed"}})
    assert "status" not in kube.get(JOBS, "digits")  # status is not written on create

    main = jobs.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "digits",
                                               {"spec": {"workers": {"replicas": 4}}, "status": {"phase": "Running"}})
    assert main["spec"]["workers"]["replicas"] == 4 and "status" not in main

    sub = jobs.patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "digits",
        {"spec": {"workers": {"replicas": 9}}, "status": {"phase": "Running", "kopf": {"progress": {"h": 1}}}})
    assert sub["spec"]["workers"]["replicas"] == 4
    assert sub["status"] == {"phase": "Running", "kopf": {"progress": {"h": 1}}}  # kopf's field is kept

    with pytest.raises(ApiException) as exc:
        jobs.patch_namespaced_custom_object_status(GROUP, VERSION, "default", PLURAL, "digits",
                                                   {"status": {"phase": "Sleeping"}})
    assert exc.value.status == 422 and "status.phase" in json.loads(exc.value.body)["message"]


def test_scale_subresource_reads_and_writes_through_the_crd_paths(kube, api):
    jobs = custom(api)
    jobs.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, job())
    kube.patch_status(JOBS, "digits", {"workers": {"replicas": 2, "ready": 1},
                                       "selector": "distbelief.io/job=digits"})
    scale = jobs.get_namespaced_custom_object_scale(GROUP, VERSION, "default", PLURAL, "digits")
    assert scale["kind"] == "Scale" and scale["apiVersion"] == "autoscaling/v1"
    assert scale["spec"] == {"replicas": 3}
    assert scale["status"] == {"replicas": 2, "selector": "distbelief.io/job=digits"}

    scaled = jobs.patch_namespaced_custom_object_scale(GROUP, VERSION, "default", PLURAL, "digits",
                                                       {"spec": {"replicas": 5}})
    assert scaled["spec"]["replicas"] == 5
    stored = kube.get(JOBS, "digits")
    assert stored["spec"]["workers"]["replicas"] == 5 and stored["metadata"]["generation"] == 2

    scaled["spec"]["replicas"] = 6
    assert jobs.replace_namespaced_custom_object_scale(GROUP, VERSION, "default", PLURAL, "digits",
                                                       scaled)["spec"]["replicas"] == 6
    with pytest.raises(ApiException) as exc:  # the Scale's resourceVersion is now stale
        jobs.replace_namespaced_custom_object_scale(GROUP, VERSION, "default", PLURAL, "digits", scaled)
    assert exc.value.status == 409


def test_scale_paths_come_from_the_crd(kube, api):
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "pools.example.com"},
           "spec": {"group": "example.com", "scope": "Namespaced",
                    "names": {"plural": "pools", "singular": "pool", "kind": "Pool"},
                    "versions": [{"name": "v1", "served": True, "storage": True,
                                  "subresources": {"status": {}, "scale": {
                                      "specReplicasPath": ".spec.size", "statusReplicasPath": ".status.up"}}}]}}
    kubernetes.client.ApiextensionsV1Api(api).create_custom_resource_definition(crd)
    code, resources = http(kube, "GET", "/apis/example.com/v1")
    assert code == 200 and {r["name"] for r in resources["resources"]} == {"pools", "pools/status", "pools/scale"}

    custom(api).create_namespaced_custom_object("example.com", "v1", "default", "pools",
                                                {"apiVersion": "example.com/v1", "kind": "Pool",
                                                 "metadata": {"name": "p"}, "spec": {"size": 2}})
    custom(api).patch_namespaced_custom_object_scale("example.com", "v1", "default", "pools", "p",
                                                     {"spec": {"replicas": 7}})
    assert kube.get("example.com/v1/pools", "p")["spec"] == {"size": 7}

    job_type = kube.resource("dbj")
    crd_scale = yaml.safe_load(JOB_CRD.read_text())["spec"]["versions"][0]["subresources"]["scale"]
    assert "." + ".".join(job_type.scale.spec_replicas) == crd_scale["specReplicasPath"]


def test_deployment_scale_shows_its_selector(kube, api):
    apps = kubernetes.client.AppsV1Api(api)
    apps.create_namespaced_deployment("default", {
        "metadata": {"name": "w"}, "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "w"}},
                                            "template": {"metadata": {"labels": {"app": "w"}}, "spec": {
                                                "containers": [{"name": "c", "image": "i"}]}}}})
    apps.patch_namespaced_deployment_scale("w", "default", {"spec": {"replicas": 4}})
    scale = apps.read_namespaced_deployment_scale("w", "default")
    assert scale.spec.replicas == 4 and scale.status.selector == "app=w"


# -------------------------------------------------------------- CRD validation


def test_crd_defaults_are_applied_on_create(kube, api):
    minimal = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DistBeliefJob", "metadata": {"name": "mini"},
               "spec": {"data": {"source": "builtin:digits"}}}
    created = custom(api).create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, minimal)
    assert created["spec"]["workers"]["replicas"] == 1
    assert created["spec"]["training"]["algorithm"] == "downpour"
    assert created["spec"]["parameterServers"]["shards"] == 1


def test_invalid_job_is_rejected_with_422_naming_the_fields(kube, api):
    bad = job()
    bad["spec"]["workers"]["replicas"] = -1
    bad["spec"]["training"]["algorithm"] = "adam"
    with pytest.raises(ApiException) as exc:
        custom(api).create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, bad)
    status = json.loads(exc.value.body)
    assert exc.value.status == 422 and status["reason"] == "Invalid"
    assert status["message"].startswith('DistBeliefJob.distbelief.io "digits" is invalid: ')
    fields = {cause["field"] for cause in status["details"]["causes"]}
    assert {"spec.workers.replicas", "spec.training.algorithm"} <= fields
    assert kube.get(JOBS, "digits") is None

    custom(api).create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, job())
    with pytest.raises(ApiException) as exc:  # updates are validated too
        custom(api).patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "digits",
                                                   {"spec": {"parameterServers": {"shards": 0}}})
    assert exc.value.status == 422 and "spec.parameterServers.shards" in json.loads(exc.value.body)["message"]


# ------------------------------------------------------------- deletion and GC


def test_finalizers_delay_deletion_until_they_are_removed(kube, api):
    kube.create("v1/configmaps", configmap("held", finalizers=["example.com/hold"]))
    code, pending = http(kube, "DELETE", "/api/v1/namespaces/default/configmaps/held")
    assert code == 200 and pending["kind"] == "ConfigMap"  # the object comes back, not a Status
    held = kube.get("v1/configmaps", "held")
    assert held["metadata"]["deletionTimestamp"] and held["metadata"]["finalizers"] == ["example.com/hold"]

    with pytest.raises(ApiException) as exc:  # no new finalizers once deletion started
        core(api).patch_namespaced_config_map("held", "default",
                                              {"metadata": {"finalizers": ["example.com/hold", "x/y"]}})
    assert exc.value.status == 422

    core(api).patch_namespaced_config_map("held", "default", {"metadata": {"finalizers": None}})
    assert kube.get("v1/configmaps", "held") is None
    with pytest.raises(ApiException) as exc:
        core(api).read_namespaced_config_map("held", "default")
    assert exc.value.status == 404


def test_owner_references_garbage_collect_recursively(kube, api):
    parent = kube.create(JOBS, job())
    child = kube.create("v1/configmaps", configmap("child", ownerReferences=[owner(parent)]))
    kube.create("v1/configmaps", configmap("grandchild", ownerReferences=[owner(child)]))
    other = kube.create("v1/configmaps", configmap("other"))
    shared = kube.create("v1/configmaps", configmap("shared", ownerReferences=[owner(parent), owner(other)]))

    deleted = custom(api).delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "digits")
    assert deleted["metadata"]["name"] == "digits"  # custom resources answer with the object
    assert kube.get("v1/configmaps", "child") is None and kube.get("v1/configmaps", "grandchild") is None
    assert kube.get("v1/configmaps", "shared")["metadata"]["uid"] == shared["metadata"]["uid"]  # one owner left


def test_foreground_deletion_waits_for_dependents_and_orphan_keeps_them(kube):
    parent = kube.create(JOBS, job())
    kube.create("v1/configmaps", configmap("held", ownerReferences=[owner(parent)], finalizers=["x/y"]))
    pending = kube.delete(JOBS, "digits", propagation="Foreground")
    assert pending is not None and "foregroundDeletion" in pending["metadata"]["finalizers"]
    assert kube.get("v1/configmaps", "held")["metadata"]["deletionTimestamp"]
    kube.patch("v1/configmaps", "held", {"metadata": {"finalizers": []}})
    assert kube.get("v1/configmaps", "held") is None and kube.get(JOBS, "digits") is None

    parent = kube.create(JOBS, job())
    kube.create("v1/configmaps", configmap("kept", ownerReferences=[owner(parent)]))
    assert kube.delete(JOBS, "digits", propagation="Orphan") is None
    assert "ownerReferences" not in kube.get("v1/configmaps", "kept")["metadata"]


# -------------------------------------------------------------------- namespaces


def test_namespaces_are_listed_read_created_on_use_and_deleted_with_their_contents(kube, api):
    names = [ns.metadata.name for ns in core(api).list_namespace().items]
    assert "default" in names and "kube-system" in names
    assert core(api).read_namespace("default").status.phase == "Active"

    core(api).create_namespaced_config_map("team-b", configmap("a"))
    assert core(api).read_namespace("team-b").metadata.name == "team-b"
    assert http(kube, "GET", "/api/v1/namespaces/team-b/configmaps/a")[0] == 200

    core(api).delete_namespace("team-b")
    assert kube.get("v1/configmaps", "a", namespace="team-b") is None
    assert kube.get("v1/namespaces", "team-b") is None


# --------------------------------------------------------------------- discovery


def test_discovery_lists_the_types_and_their_subresources(kube, api):
    code, jobs = http(kube, "GET", "/apis/distbelief.io/v1alpha1")
    by_name = {r["name"]: r for r in jobs["resources"]}
    assert by_name["distbeliefjobs"]["shortNames"] == ["dbj"] and by_name["distbeliefjobs"]["namespaced"]
    assert "watch" in by_name["distbeliefjobs"]["verbs"]
    assert by_name["distbeliefjobs/status"]["kind"] == "DistBeliefJob"
    assert (by_name["distbeliefjobs/scale"]["group"], by_name["distbeliefjobs/scale"]["kind"]) == ("autoscaling", "Scale")

    groups = {g.name: g for g in kubernetes.client.ApisApi(api).get_api_versions().groups}
    assert {"apps", "autoscaling", "networking.k8s.io", "events.k8s.io", "coordination.k8s.io",
            "apiextensions.k8s.io", "distbelief.io", "kopf.dev"} <= set(groups)
    kopf_types = {r["name"]: r["namespaced"] for r in http(kube, "GET", "/apis/kopf.dev/v1")[1]["resources"]}
    assert kopf_types == {"kopfpeerings": True, "clusterkopfpeerings": False}
    assert kubernetes.client.VersionApi(api).get_code().git_version == "v1.30.0"
    core_names = {r["name"] for r in http(kube, "GET", "/api/v1")[1]["resources"]}
    assert {"namespaces", "configmaps", "services", "pods", "events", "secrets", "pods/status"} <= core_names


def test_kubectl_tables_come_from_the_printer_columns(kube):
    kube.create(JOBS, job())
    kube.patch_status(JOBS, "digits", {"phase": "Running", "globalStep": 12, "workers": {"ready": 3}})
    code, table = http(kube, "GET", "/apis/distbelief.io/v1alpha1/namespaces/default/distbeliefjobs",
                       accept="application/json;as=Table;v=v1;g=meta.k8s.io, application/json")
    assert code == 200 and table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == [
        "Name", "Phase", "Workers", "Shards", "Step", "Progress", "ETA", "Loss", "Accuracy", "Age"]
    (row,) = table["rows"]
    assert row["cells"][:5] == ["digits", "Running", 3, None, 12] and row["cells"][-1].endswith("s")
    assert row["object"]["metadata"]["name"] == "digits"

    request = urllib.request.Request(  # kubectl get --watch: one-row Tables as the events' objects
        f"{kube.url}/apis/distbelief.io/v1alpha1/namespaces/default/distbeliefjobs?watch=true&timeoutSeconds=5",
        headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io, application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        event = json.loads(response.readline())
    assert event["type"] == "ADDED" and event["object"]["kind"] == "Table"
    assert event["object"]["rows"][0]["cells"][:2] == ["digits", "Running"]


# ------------------------------------------------------------ pure helper checks


def test_label_selector_parsing_and_human_ages():
    import datetime

    (check,) = objects.parse_label_selector("tier in (a,b)")
    assert check({"tier": "a"}) and not check({"tier": "c"})
    with pytest.raises(ValueError):
        objects.parse_label_selector("a in b")
    ages = [objects.human_age(datetime.timedelta(seconds=s)) for s in (5, 150, 1200, 7380, 4 * 3600 + 180, 3 * 86400)]
    assert ages == ["5s", "2m30s", "20m", "123m", "4h3m", "3d"]  # as kubectl shows them


# ---------------------------------------------------------- real clients: kopf


OPERATOR = '''
import kopf
import kubernetes


@kopf.on.create("distbelief.io", "v1alpha1", "distbeliefjobs")
def created(name, namespace, body, patch, **_):
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-config"},
          "data": {"workers": str(body["spec"]["workers"]["replicas"])}}
    kopf.adopt(cm)
    kubernetes.client.CoreV1Api().create_namespaced_config_map(namespace, cm)
    patch.status["phase"] = "Running"


@kopf.on.delete("distbelief.io", "v1alpha1", "distbeliefjobs")
def deleted(**_):
    pass
'''


def test_kopf_operator_gets_past_its_first_write(kube, tmp_path):
    handlers = tmp_path / "handlers.py"
    handlers.write_text(OPERATOR)
    log = tmp_path / "kopf.log"
    with log.open("w") as out:
        operator = subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", "--standalone", "--namespace", "default", "--verbose",
             str(handlers)], env=kube.env(), stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        kube.create(JOBS, job())
        try:
            cm = kube.wait_for("v1/configmaps", "digits-config", timeout=20)
            running = kube.wait_for(JOBS, "digits", timeout=20,
                                    condition=lambda o: bool(o and o.get("status", {}).get("phase") == "Running"))
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nkopf log:\n{log.read_text()[-4000:]}") from None
        assert cm["data"] == {"workers": "3"}
        assert cm["metadata"]["ownerReferences"][0]["uid"] == running["metadata"]["uid"]
        assert running["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]

        assert kube.delete(JOBS, "digits") is not None  # kopf's finalizer holds it...
        kube.wait_for(JOBS, "digits", condition=lambda o: o is None, timeout=20)  # ...until kopf lets go
        assert kube.get("v1/configmaps", "digits-config") is None  # and the child is collected
        patches = {r.content_type for r in kube.requests if r.method == "PATCH"}
        assert {"application/json-patch+json", "application/merge-patch+json"} <= patches
        assert all(r.code < 500 for r in kube.requests)
    finally:
        operator.terminate()
        try:
            operator.wait(10)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait(5)


# -------------------------------------------------------- real clients: kubectl


def kubectl_binary() -> str | None:
    cache = Path(os.environ.get("DISTBELIEF_KUBE_TOOLS") or REPO / ".cache" / "kube-tools")
    candidate = cache / "bin" / "kubectl"
    return str(candidate) if os.access(candidate, os.X_OK) else shutil.which("kubectl")


KUBECTL = kubectl_binary()
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="no kubectl: run tools/fetch-kube-tools to fetch it")


@needs_kubectl
def test_kubectl_apply_get_scale_delete(kube):
    def kubectl(*args: str) -> str:
        done = subprocess.run([KUBECTL, "--kubeconfig", str(kube.kubeconfig), "--request-timeout=10s", *args],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    assert "distbeliefjob.distbelief.io/digits created" in kubectl("apply", "--validate=false", "-f", str(EXAMPLE))
    kube.patch_status(JOBS, "digits", {"phase": "Running", "globalStep": 7, "progress": 42.5, "eta": "3m20s"})
    header, row = kubectl("get", "dbj").splitlines()
    assert header.split() == ["NAME", "PHASE", "WORKERS", "SHARDS", "STEP", "PROGRESS", "ETA", "LOSS", "ACCURACY",
                              "AGE"]
    assert row.split()[:5] == ["digits", "Running", "7", "42.5", "3m20s"]

    assert "scaled" in kubectl("scale", "dbj/digits", "--replicas=5")
    scaled = kube.get(JOBS, "digits")
    assert scaled["spec"]["workers"]["replicas"] == 5 and scaled["metadata"]["generation"] == 2

    changed = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    changed["spec"]["training"]["maxSteps"] = 9000
    (kube.kubeconfig.parent / "changed.yaml").write_text(yaml.safe_dump(changed))
    assert "configured" in kubectl("apply", "--validate=false", "-f", str(kube.kubeconfig.parent / "changed.yaml"))
    assert kube.get(JOBS, "digits")["spec"]["training"]["maxSteps"] == 9000

    assert "deleted" in kubectl("delete", "dbj", "digits")
    assert kube.get(JOBS, "digits") is None
    assert "No resources found" in subprocess.run(
        [KUBECTL, "--kubeconfig", str(kube.kubeconfig), "get", "dbj"], capture_output=True, text=True,
        timeout=30).stderr
