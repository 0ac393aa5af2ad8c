"""Pod placement and overrides per role: spec.parameterServers.template, spec.workers.template
and spec.imagePullSecrets, merged onto the rendered pods; what the operator owns refused."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from distbelief.operator import errors
from distbelief.operator.render import placement, render
from distbelief.operator.validation import spec, templates
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract

from support.examples import load_example

K8S_VERSION = "1.30"
IMAGE = "registry.example/distbelief:test"

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
ZONE_SPREAD = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": {"team": "ml"}}}
NODE_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]}}}
WORKER_TEMPLATE = {
    "metadata": {"labels": {"team": "ml"}, "annotations": {"example.com/cost-center": "42"}},
    "spec": {
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [GPU_TOLERATION],
        "affinity": NODE_AFFINITY,
        "topologySpreadConstraints": [ZONE_SPREAD],
        "priorityClassName": "training-high",
        "imagePullSecrets": [{"name": "worker-registry"}],
        "serviceAccountName": "trainer",
        "schedulerName": "gang-scheduler",
        "volumes": [{"name": "cache", "emptyDir": {"medium": "Memory"}}],
        "containers": [{"name": "worker", "env": [{"name": "HF_HOME", "value": "/cache"}],
                        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}],
    },
}


def job(**spec_fields: Any) -> dict[str, Any]:
    doc = copy.deepcopy(load_example("digits-mlp.yaml"))
    doc["metadata"]["uid"] = "uid-1"
    for path, value in spec_fields.items():
        node = doc["spec"]
        *parents, last = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = copy.deepcopy(value)
    return spec.validate_job(doc)


def pods(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The pod template of each workload, by kind."""
    return {o["kind"]: o["spec"]["template"] for o in render.render_children(DistBeliefJob.of(doc), image=IMAGE)
            if o["kind"] in ("StatefulSet", "Deployment")}


def refusals(**spec_fields: Any) -> list[str]:
    with pytest.raises(errors.SpecError) as raised:
        job(**spec_fields)
    return list(raised.value.errors)


def test_every_field_of_a_worker_template_lands_on_the_worker_pods_only() -> None:
    rendered = pods(job(workers__template=WORKER_TEMPLATE))
    worker, ps = rendered["Deployment"], rendered["StatefulSet"]
    assert worker["metadata"]["labels"]["team"] == "ml"
    assert worker["metadata"]["labels"][contract.LABEL_ROLE] == contract.ROLE_WORKER   # ours kept
    assert worker["metadata"]["annotations"]["example.com/cost-center"] == "42"
    pod = worker["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["tolerations"] == [GPU_TOLERATION]
    assert pod["affinity"] == NODE_AFFINITY
    assert pod["topologySpreadConstraints"] == [ZONE_SPREAD]
    assert (pod["priorityClassName"], pod["serviceAccountName"], pod["schedulerName"]) == (
        "training-high", "trainer", "gang-scheduler")
    assert pod["imagePullSecrets"] == [{"name": "worker-registry"}]
    assert pod["automountServiceAccountToken"] is False   # a service account, still no token
    assert [v["name"] for v in pod["volumes"]][-1] == "cache"
    container = pod["containers"][0]
    assert container["env"][-1] == {"name": "HF_HOME", "value": "/cache"}
    assert container["env"][0]["name"] == contract.ENV_POD_NAME
    assert container["volumeMounts"][-1] == {"name": "cache", "mountPath": "/cache"}
    assert container["command"] == ["distbelief", contract.ROLE_WORKER]
    for key in ("nodeSelector", "tolerations", "priorityClassName", "imagePullSecrets", "serviceAccountName"):
        assert key not in ps["spec"], key
    assert "team" not in ps["metadata"]["labels"]


def test_the_rendered_children_with_templates_pass_the_kubernetes_schema() -> None:
    doc = job(workers__template=WORKER_TEMPLATE, parameterServers__template={"spec": {"tolerations": [GPU_TOLERATION]}},
              imagePullSecrets=[{"name": "registry"}])
    for obj in render.render_children(DistBeliefJob.of(doc), image=IMAGE):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_partition_of_a_partitioned_job_gets_the_worker_template() -> None:
    doc = load_example("digits-partitioned.yaml")
    doc["spec"].setdefault("workers", {})["template"] = {"spec": {"nodeSelector": {"pool": "gpu"}}}
    deployments = [o for o in render.render_children(DistBeliefJob.validated(doc), image=IMAGE) if o["kind"] == "Deployment"]
    assert len(deployments) > 1
    assert all(d["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu"} for d in deployments)


def test_job_wide_pull_secrets_reach_every_pod_and_add_to_a_roles_own() -> None:
    rendered = pods(job(imagePullSecrets=[{"name": "registry"}],
                        parameterServers__template={"spec": {"imagePullSecrets": [{"name": "ps-registry"},
                                                                                  {"name": "registry"}]}}))
    assert rendered["Deployment"]["spec"]["imagePullSecrets"] == [{"name": "registry"}]
    assert rendered["StatefulSet"]["spec"]["imagePullSecrets"] == [{"name": "registry"}, {"name": "ps-registry"}]


def test_a_users_anti_affinity_adds_to_the_spreading_of_shard_copies() -> None:
    theirs = {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "podAffinityTerm": {
        "labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": "kubernetes.io/hostname"}}]}
    ps = pods(job(parameterServers__backups=1,
                  parameterServers__template={"spec": {"affinity": {"podAntiAffinity": theirs}}}))["StatefulSet"]
    terms = ps["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert [t["weight"] for t in terms] == [100, 10]   # the copies' spreading first, then the user's


def test_a_template_changes_the_config_hash_so_pods_are_replaced() -> None:
    def hash_of(doc: dict[str, Any]) -> str:
        return pods(doc)["Deployment"]["metadata"]["annotations"]["distbelief.io/config-hash"]
    assert hash_of(job()) != hash_of(job(workers__template={"spec": {"nodeSelector": {"pool": "gpu"}}}))


def test_add_placement_merges_an_admissions_node_selector_and_tolerations() -> None:
    rendered = pods(job(workers__template={"spec": {"nodeSelector": {"pool": "gpu"}, "tolerations": [GPU_TOLERATION]}}))
    admitted = placement.add_placement(rendered["Deployment"], {"cloud.example/flavor": "spot"},
                                       [{"key": "spot", "operator": "Exists"}])
    assert admitted["spec"]["nodeSelector"] == {"pool": "gpu", "cloud.example/flavor": "spot"}
    assert admitted["spec"]["tolerations"] == [GPU_TOLERATION, {"key": "spot", "operator": "Exists"}]
    assert "cloud.example/flavor" not in rendered["Deployment"]["spec"]["nodeSelector"]   # a new dict


@pytest.mark.parametrize("template, path, named", [
    ({"metadata": {"labels": {contract.LABEL_ROLE: "x"}}}, "template.metadata.labels", contract.LABEL_ROLE),
    ({"metadata": {"labels": {"app.kubernetes.io/instance": "x"}}}, "template.metadata.labels",
     "app.kubernetes.io/instance"),
    ({"metadata": {"annotations": {"distbelief.io/config-hash": "0"}}}, "template.metadata.annotations",
     "distbelief.io/config-hash"),
    ({"spec": {"securityContext": {"runAsUser": 0}}}, "template.spec", "securityContext"),
    ({"spec": {"hostNetwork": True}}, "template.spec", "hostNetwork"),
    ({"spec": {"volumes": [{"name": "keys", "emptyDir": {}}]}}, "template.spec.volumes", "keys"),
    ({"spec": {"containers": [{"command": ["sh"]}]}}, "template.spec.containers[0]", "command"),
    ({"spec": {"containers": [{"ports": [{"containerPort": 1}]}]}}, "template.spec.containers[0]", "ports"),
    ({"spec": {"containers": [{"livenessProbe": {}}]}}, "template.spec.containers[0]", "livenessProbe"),
    ({"spec": {"containers": [{"resources": {}}]}}, "template.spec.containers[0]", "resources"),
    ({"spec": {"containers": [{"env": [{"name": "DISTBELIEF_PS_ADDRESSES", "value": "x"}]}]}},
     "template.spec.containers[0].env", "DISTBELIEF_PS_ADDRESSES"),
    ({"spec": {"containers": [{"env": [{"name": "OMP_NUM_THREADS", "value": "64"}]}]}},
     "template.spec.containers[0].env", "OMP_NUM_THREADS"),
    ({"spec": {"containers": [{"volumeMounts": [{"name": "x", "mountPath": "/etc/distbelief-keys/a"}]}]}},
     "template.spec.containers[0].volumeMounts", "/etc/distbelief-keys/a"),
    ({"spec": {"containers": [{"name": "sidecar"}]}}, "template.spec.containers", "sidecar"),
    ({"spec": {"dnsPolicy": "None"}}, "template.spec.dnsPolicy", "unknown"),
])
def test_what_the_operator_owns_is_refused_naming_it(template: dict[str, Any], path: str, named: str) -> None:
    lines = refusals(workers__template=template)
    line = next((line for line in lines if line.startswith(f"spec.workers.{path}:")), None)
    assert line is not None, lines
    assert named in line, line


def test_every_env_name_label_and_volume_the_renderer_sets_is_refused_in_a_template() -> None:
    """The refusal lists cover what the renderer really writes, partitioned jobs included."""
    doc = load_example("digits-partitioned.yaml")
    doc["spec"]["workers"] = {"resources": {"limits": {"cpu": "1"}}}
    for obj in render.render_children(DistBeliefJob.validated(doc), image=IMAGE):
        if obj["kind"] not in ("StatefulSet", "Deployment"):
            continue
        pod = obj["spec"]["template"]
        assert all(templates.owned_label(k) for k in pod["metadata"]["labels"])
        assert all(templates.owned_env(e["name"]) for e in pod["spec"]["containers"][0]["env"])
        assert {v["name"] for v in pod["spec"]["volumes"]} <= set(templates.OWNED_VOLUMES)
        assert all(templates.owned_mount(m["mountPath"]) for m in pod["spec"]["containers"][0]["volumeMounts"])


def test_a_container_named_for_its_role_is_accepted() -> None:
    doc = job(parameterServers__template={"spec": {"containers": [{"name": "ps", "env": [{"name": "A", "value": "1"}]}]}})
    assert pods(doc)["StatefulSet"]["spec"]["containers"][0]["env"][-1] == {"name": "A", "value": "1"}
    assert any("name ps" in line for line in refusals(parameterServers__template={"spec": {"containers": [{"name": "worker"}]}}))
