"""The children rendered for a DistBeliefJob (distbelief.operator.render)."""

from __future__ import annotations

import base64
import copy
import hashlib
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import kubernetes_validate
import pytest
import yaml

from distbelief.operator import errors
from distbelief.operator.render import context, deployment, podparts, render, secret, sizing
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract, keys

from support.examples import load_example
from support.paths import REPO

pytestmark = pytest.mark.floors  # also run against the lowest dependency versions

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
K8S_VERSION = "1.30"
IMAGE = "registry.example/distbelief:test"
JOB_API_VERSION = f"{contract.API_GROUP}/{contract.API_VERSION}"
KINDS = ["ConfigMap", "Service", "StatefulSet", "Deployment"]


def example(name: str) -> dict[str, Any]:
    (doc,) = spec.load_manifests(str(REPO / "examples" / name))
    return doc


def _suspended(doc: dict[str, Any]) -> None:
    doc["spec"]["runPolicy"] = {"suspend": True}


def _autoscaled(doc: dict[str, Any]) -> None:
    doc["spec"]["workers"]["autoscaling"] = {"maxReplicas": 6}


def _stored(doc: dict[str, Any]) -> None:
    doc["metadata"].update(uid="6f1c-uid", namespace="ml")


def _everything(doc: dict[str, Any]) -> None:
    _stored(doc)
    doc["spec"]["image"] = "mine:1"
    doc["spec"]["model"] = {"entrypoint": "my_pkg.models:build"}
    if doc["spec"]["data"]["source"].startswith("synthetic-ctr:"):  # ids only: a user model needs x
        doc["spec"]["data"]["source"] = "synthetic:features=8,classes=2,samples=100"
    doc["spec"]["parameterServers"]["checkpoint"]["storage"].update(
        storageClassName="fast", retention="Delete")


VARIANTS: dict[str, Callable[[dict[str, Any]], None]] = {
    "as-is": lambda doc: None,
    "suspended": _suspended,
    "autoscaled": _autoscaled,
    "stored": _stored,
    "everything": _everything,
}


def job_of(name: str = "digits-mlp.yaml", variant: str = "as-is") -> dict[str, Any]:
    doc = example(name)
    VARIANTS[variant](doc)
    return spec.validate_job(doc)


def rendered(job: dict[str, Any], **options: Any) -> list[dict[str, Any]]:
    """The children of a validated job's manifest."""
    return render.render_children(DistBeliefJob.of(job), **options)


def children(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in rendered(job, image=IMAGE)}


def pod_specs(objs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [objs[k]["spec"]["template"]["spec"] for k in ("StatefulSet", "Deployment")]


CASES = [(e.name, v) for e in EXAMPLES for v in VARIANTS]


@pytest.mark.parametrize("name, variant", CASES)
def test_every_child_passes_the_kubernetes_schema(name: str, variant: str) -> None:
    objs = rendered(job_of(name, variant), image=IMAGE)
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert [o["kind"] for o in objs][:4] == KINDS


def test_strict_validation_would_catch_a_typo() -> None:
    obj = children(job_of())["Deployment"]
    obj["spec"]["replicaz"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_names_namespace_and_labels() -> None:
    job = job_of(variant="stored")
    names = contract.JobNames("digits")
    objs = rendered(job, image=IMAGE)
    assert [o["metadata"]["name"] for o in objs] == [
        names.config_map, names.ps, names.ps, names.worker, names.ps, names.ps]   # the PDB, the NetworkPolicy
    for obj in objs:
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "distbelief"
        assert labels["app.kubernetes.io/instance"] == "digits"
        assert labels["app.kubernetes.io/managed-by"] == "distbelief-operator"
        assert labels[contract.LABEL_JOB] == "digits"
        assert labels["app.kubernetes.io/component"] == labels[contract.LABEL_ROLE]
    assert objs[0]["metadata"]["labels"]["app.kubernetes.io/component"] == "config"


def test_namespace_defaults_to_default() -> None:
    for obj in rendered(job_of(), image=IMAGE):
        assert obj["metadata"]["namespace"] == "default"


def test_selectors_match_pod_labels() -> None:
    objs = children(job_of())
    sts, deploy, svc = objs["StatefulSet"], objs["Deployment"], objs["Service"]
    ps_labels = sts["spec"]["template"]["metadata"]["labels"]
    worker_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"] == contract.selector_labels("digits", contract.ROLE_PS)
    assert svc["spec"]["selector"].items() <= ps_labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= ps_labels.items()
    assert deploy["spec"]["selector"]["matchLabels"] == \
        contract.selector_labels("digits", contract.ROLE_WORKER)
    assert deploy["spec"]["selector"]["matchLabels"].items() <= worker_labels.items()
    assert not svc["spec"]["selector"].items() <= worker_labels.items()


def test_headless_service_ports() -> None:
    job = job_of()
    svc = children(job)["Service"]["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    ports = {p["name"]: p["port"] for p in svc["ports"]}
    assert ports == {contract.SHARD_PORT_NAME: job["spec"]["parameterServers"]["port"],
                     contract.METRICS_PORT_NAME: contract.METRICS_PORT, contract.BULK_PORT_NAME: contract.BULK_PORT}


def test_statefulset_one_pod_and_one_volume_per_shard() -> None:
    job = job_of(variant="everything")
    sts = children(job)["StatefulSet"]["spec"]
    assert sts["replicas"] == job["spec"]["parameterServers"]["shards"] == 2
    assert sts["serviceName"] == contract.JobNames("digits").ps
    assert sts["podManagementPolicy"] == "Parallel"
    assert sts["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete",
                                                           "whenScaled": "Retain"}
    (claim,) = sts["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == contract.CHECKPOINT_VOLUME
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    assert "storageClassName" not in children(job_of())["StatefulSet"]["spec"][
        "volumeClaimTemplates"][0]["spec"]


def test_ps_container() -> None:
    job = job_of()
    (c,) = children(job)["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    assert c["name"] == contract.ROLE_PS
    assert c["command"] == ["distbelief", "ps"]
    assert c["args"] == ["--config", contract.CONFIG_PATH,
                         "--checkpoint-dir", contract.CHECKPOINT_DIR, "--keys-dir", contract.KEYS_DIR]
    assert {"name": contract.CHECKPOINT_VOLUME, "mountPath": contract.CHECKPOINT_DIR} \
        in c["volumeMounts"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        contract.SHARD_PORT_NAME: job["spec"]["parameterServers"]["port"],
        contract.METRICS_PORT_NAME: contract.METRICS_PORT, contract.BULK_PORT_NAME: contract.BULK_PORT}
    assert c["resources"] == job["spec"]["parameterServers"]["resources"]


def test_worker_container() -> None:
    job = job_of()
    deploy = children(job)["Deployment"]["spec"]
    assert deploy["replicas"] == job["spec"]["workers"]["replicas"] == 3
    assert deploy["strategy"]["type"] == "RollingUpdate"
    (c,) = deploy["template"]["spec"]["containers"]
    assert c["name"] == contract.ROLE_WORKER
    assert c["command"] == ["distbelief", "worker"]
    assert c["args"] == ["--config", contract.CONFIG_PATH, "--keys-dir", contract.KEYS_DIR]
    assert [p["name"] for p in c["ports"]] == [contract.METRICS_PORT_NAME]
    assert c["resources"] == job["spec"]["workers"]["resources"]


def test_containers_get_identity_probes_and_mounts() -> None:
    for pod in pod_specs(children(job_of())):
        (c,) = pod["containers"]
        assert c["image"] == IMAGE
        assert {"name": contract.ENV_POD_NAME,
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz",
                                                 "port": contract.METRICS_PORT_NAME}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz",
                                                  "port": contract.METRICS_PORT_NAME}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts[contract.CONFIG_DIR]["readOnly"] is True
        assert contract.SCRATCH_DIR in mounts
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts[contract.CONFIG_DIR]["name"]]["configMap"]["name"] == \
            contract.JobNames("digits").config_map
        assert "emptyDir" in volumes[mounts[contract.SCRATCH_DIR]["name"]]


def test_every_pod_mounts_the_job_keys_read_only_and_a_replica_never_the_server_secret() -> None:
    objs = children(job_of())
    for kind, files in (("StatefulSet", None), ("Deployment", list(keys.CLIENT_FILES))):
        pod = objs[kind]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts[contract.KEYS_DIR] == {"name": contract.KEYS_VOLUME, "mountPath": contract.KEYS_DIR,
                                             "readOnly": True}
        assert c["args"][-2:] == ["--keys-dir", contract.KEYS_DIR]
        volume = {v["name"]: v for v in pod["volumes"]}[contract.KEYS_VOLUME]["secret"]
        assert volume["secretName"] == contract.JobNames("digits").keys_secret == "digits-keys"
        assert volume["defaultMode"] == 0o400 and "optional" not in volume  # a pod waits for its keys
        assert [i["key"] for i in volume.get("items", [])] == (files or [])
        assert files is None or keys.SERVER_SECRET not in files
        # not inside the ConfigMap's read-only mount: the runtime could not create the mount point
        assert not contract.KEYS_DIR.startswith(contract.CONFIG_DIR + "/")


@pytest.mark.parametrize("variant", ["as-is", "stored"])
def test_the_keys_secret_is_immutable_owned_and_holds_the_key_files(variant: str) -> None:
    job_keys = keys.JobKeys.generate()
    made = secret.render_keys_secret(DistBeliefJob.of(job_of(variant=variant)), job_keys.files())
    kubernetes_validate.validate(made, K8S_VERSION, strict=True)
    assert (made["kind"], made["metadata"]["name"], made["type"]) == ("Secret", "digits-keys", "Opaque")
    assert made["immutable"] is True
    assert made["metadata"]["labels"][contract.LABEL_JOB] == "digits"
    decoded = {k: base64.b64decode(v).decode() for k, v in made["data"].items()}
    assert decoded == job_keys.files() and sorted(decoded) == sorted(keys.FILES)
    owners = made["metadata"].get("ownerReferences")
    assert (owners[0]["uid"] == "6f1c-uid") if variant == "stored" else owners is None
    assert "Secret" not in children(job_of())  # made once by the operator, never re-applied


def test_every_role_runs_with_the_role_environment() -> None:
    for pod in pod_specs(children(job_of())):
        (c,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert {name: env.get(name) for name in contract.ROLE_ENV} == contract.ROLE_ENV


def test_no_resources_key_when_the_spec_sets_none() -> None:
    job = job_of()
    del job["spec"]["workers"]["resources"]["requests"]
    del job["spec"]["workers"]["resources"]["limits"]
    (c,) = children(job)["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert "resources" not in c


def thread_env(job: dict[str, Any], kind: str) -> dict[str, str]:
    (c,) = children(job)[kind]["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in c["env"] if e["name"] in podparts.THREAD_ENV}


@pytest.mark.parametrize("resources, threads", [
    ({"requests": {"cpu": "250m"}}, "1"),          # a fraction of a core still gets one thread
    ({"requests": {"cpu": "1500m"}}, "2"),         # rounded up
    ({"requests": {"cpu": 3}}, "3"),               # an integer quantity
    ({"requests": {"cpu": "1"}, "limits": {"cpu": "4"}}, "4"),  # the limit, when set, wins
    ({"limits": {"cpu": "2.5"}}, "3"),
])
def test_blas_threads_follow_the_pods_cpus(resources: dict[str, Any], threads: str) -> None:
    job = job_of()
    job["spec"]["workers"]["resources"] = resources
    job["spec"]["parameterServers"]["resources"] = resources
    for kind in ("Deployment", "StatefulSet"):
        assert thread_env(job, kind) == {name: threads for name in podparts.THREAD_ENV}


def test_no_thread_setting_without_a_cpu_quantity() -> None:
    job = job_of()
    job["spec"]["workers"]["resources"] = {"requests": {"memory": "1Gi"}}
    assert thread_env(job, "Deployment") == {}


@pytest.mark.parametrize("quantity, cores", [("100m", "0.1"), ("2", "2"), ("1k", "1000"), ("0.5", "0.5"), (4, "4")])
def test_cpu_quantities_in_cores(quantity: Any, cores: str) -> None:
    assert podparts.cpu_cores(quantity) == Decimal(cores)


@pytest.mark.parametrize("name, variant", CASES)
def test_every_pod_and_container_is_hardened(name: str, variant: str) -> None:
    for pod in pod_specs(children(job_of(name, variant))):
        assert pod["securityContext"] == {
            "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
            "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}}
        # No token mounted by admission; the shard copies' own one is a volume of the pod.
        assert pod["automountServiceAccountToken"] is False
        tokens = [v for v in pod["volumes"] if "projected" in v]
        assert len(tokens) == (pod.get("serviceAccountName") == "digits-ps")
        assert pod["enableServiceLinks"] is False
        assert pod["terminationGracePeriodSeconds"] == 30
        for c in pod["containers"]:
            assert c["securityContext"] == {
                "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


def test_suspend_scales_everything_to_zero() -> None:
    objs = children(job_of(variant="suspended"))
    assert objs["StatefulSet"]["spec"]["replicas"] == 0
    assert objs["Deployment"]["spec"]["replicas"] == 0


def test_no_hpa_without_autoscaling() -> None:
    assert "HorizontalPodAutoscaler" not in children(job_of())


def test_hpa_scales_the_job_itself_with_the_default_cpu_metric() -> None:
    job = job_of(variant="autoscaled")
    objs = rendered(job, image=IMAGE)
    (hpa,) = [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["metadata"]["name"] == contract.JobNames("digits").worker
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": JOB_API_VERSION,
                                             "kind": contract.KIND, "name": "digits"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6)
    assert hpa["spec"]["metrics"] == [{"type": "Resource", "resource": {
        "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}]
    assert "behavior" not in hpa["spec"]   # the autoscaler's own defaults
    # the Deployment keeps the spec's replicas: the HPA writes them through the job
    deploy = next(o for o in objs if o["kind"] == "Deployment")
    assert deploy["spec"]["replicas"] == job["spec"]["workers"]["replicas"]


def test_hpa_takes_the_behavior_of_the_spec() -> None:
    job = job_of(variant="autoscaled")
    behavior = {"scaleDown": {"stabilizationWindowSeconds": 15,
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 15}]}}
    job["spec"]["workers"]["autoscaling"]["behavior"] = behavior
    assert children(job)["HorizontalPodAutoscaler"]["spec"]["behavior"] == behavior


def test_hpa_uses_the_metrics_of_the_spec() -> None:
    job = job_of("synthetic-large.yaml")
    hpa = children(job)["HorizontalPodAutoscaler"]["spec"]
    autoscaling = job["spec"]["workers"]["autoscaling"]
    assert hpa["metrics"] == autoscaling["metrics"]
    assert hpa["metrics"] is not autoscaling["metrics"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 8)


def test_empty_metrics_list_gets_the_default_metric() -> None:
    doc = example("digits-mlp.yaml")
    doc["spec"]["workers"]["autoscaling"] = {"maxReplicas": 4, "metrics": []}
    hpa = children(spec.validate_job(doc))["HorizontalPodAutoscaler"]["spec"]
    assert hpa["metrics"][0]["resource"]["name"] == "cpu"


@pytest.mark.parametrize("variant, owned", [("as-is", False), ("stored", True)])
def test_owner_references_iff_the_job_has_a_uid(variant: str, owned: bool) -> None:
    for obj in rendered(job_of("synthetic-large.yaml", variant), image=IMAGE):
        refs = obj["metadata"].get("ownerReferences")
        if not owned:
            assert refs is None
            continue
        assert refs == [{"apiVersion": JOB_API_VERSION, "kind": contract.KIND,
                         "name": "synthetic-large", "uid": "6f1c-uid",
                         "controller": True, "blockOwnerDeletion": True}]


def test_image_from_the_spec_wins() -> None:
    for pod in pod_specs(children(job_of(variant="everything"))):
        assert pod["containers"][0]["image"] == "mine:1"


def test_config_map_round_trips_the_defaulted_spec() -> None:
    job = job_of(variant="stored")
    cm = children(job)["ConfigMap"]
    config = contract.JobConfig.from_json(cm["data"][contract.CONFIG_KEY])
    assert (config.name, config.namespace) == ("digits", "ml")
    assert config.written == job["spec"]
    assert config.spec.parameter_servers.shards == job["spec"]["parameterServers"]["shards"]
    assert config.shard_addresses({})[1] == \
        contract.JobNames("digits").shard_address(1, "ml", config.spec.parameter_servers.port)


def _hashes(job: dict[str, Any]) -> set[str]:
    objs = children(job)
    return {o["spec"]["template"]["metadata"]["annotations"][podparts.CONFIG_HASH_ANNOTATION]
            for o in (objs["StatefulSet"], objs["Deployment"])}


def test_config_hash_is_of_the_config_and_the_same_on_every_pod() -> None:
    job = job_of()
    (value,) = _hashes(job)
    assert len(value) == 16 and int(value, 16) >= 0
    assert value == context.config_hash(spec.job_config(job))
    assert value != hashlib.sha256(b"").hexdigest()[:16]


def test_config_hash_changes_when_the_training_spec_changes() -> None:
    job = job_of()
    before = _hashes(job)
    job["spec"]["training"]["learningRate"] = 0.5
    assert _hashes(job) != before


def test_config_hash_ignores_scaling_and_suspending() -> None:
    # scaling through the scale subresource (HPA) must not restart shards or replicas
    job = job_of()
    before = _hashes(job)
    job["spec"]["workers"]["replicas"] = 7
    job["spec"]["workers"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 9}
    job["spec"]["runPolicy"]["suspend"] = True
    assert _hashes(job) == before


def test_render_is_pure() -> None:
    job = job_of("synthetic-large.yaml", "everything")
    frozen = copy.deepcopy(job)
    first = rendered(job, image=IMAGE)
    assert job == frozen
    assert rendered(job, image=IMAGE) == first


def test_to_yaml_is_multi_document_and_round_trips() -> None:
    objs = rendered(job_of("synthetic-large.yaml", "stored"), image=IMAGE)
    text = render.to_yaml(objs)
    assert text.startswith("---\n")
    assert text.count("\n---\n") == len(objs) - 1
    assert list(yaml.safe_load_all(text)) == objs
    first = text.splitlines()[1:4]
    assert first == ["apiVersion: v1", "kind: ConfigMap", "metadata:"]
    assert f"  {contract.CONFIG_KEY}: |" in text  # the config JSON reads as a block


@pytest.mark.parametrize("clean_pod_policy, shard_replicas", [("All", 0), ("None", 2)])
def test_a_finished_job_runs_no_replicas_and_no_autoscaler(clean_pod_policy: str, shard_replicas: int) -> None:
    doc = example("digits-mlp.yaml")
    _autoscaled(doc)
    doc["spec"]["runPolicy"]["cleanPodPolicy"] = clean_pod_policy
    children = {c["kind"]: c for c in rendered(spec.validate_job(doc), image=IMAGE, finished=True)}
    assert children["Deployment"]["spec"]["replicas"] == 0
    assert children["StatefulSet"]["spec"]["replicas"] == shard_replicas
    assert "HorizontalPodAutoscaler" not in children


def test_only_an_encrypted_job_opens_and_admits_the_bulk_port() -> None:
    doc = example("digits-mlp.yaml")
    doc["spec"]["parameterServers"]["encryption"] = False
    plain = {c["kind"]: c for c in rendered(spec.validate_job(doc), image=IMAGE)}
    encrypted = children(job_of())
    for objects, bulk in ((plain, False), (encrypted, True)):
        (container,) = objects["StatefulSet"]["spec"]["template"]["spec"]["containers"]
        admitted = {p["port"] for rule in objects["NetworkPolicy"]["spec"]["ingress"] for p in rule["ports"]}
        assert (contract.BULK_PORT in {p["containerPort"] for p in container["ports"]}) is bulk
        assert (contract.BULK_PORT in admitted) is bulk


def test_the_network_policy_is_on_by_default_and_covers_every_pod_and_port() -> None:
    job = spec.validate_job(example("digits-mlp.yaml"))
    children = {c["kind"]: c for c in rendered(job, image=IMAGE, operator_namespace="ops")}
    policy = children["NetworkPolicy"]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    shard_pods = children["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    worker_pods = children["Deployment"]["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= shard_pods.items() and selector.items() <= worker_pods.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    job_rule, operator_rule = policy["spec"]["ingress"]
    # The job's own pods: a podSelector alone, which means the policy's namespace only.
    (peers,) = job_rule["from"]
    assert list(peers) == ["podSelector"] and peers["podSelector"]["matchLabels"] == {"distbelief.io/job": "digits"}
    port = job["spec"]["parameterServers"]["port"]
    assert job_rule["ports"] == [{"protocol": "TCP", "port": port}, {"protocol": "TCP", "port": contract.BULK_PORT}]
    # The operator: its pods, in its namespace only (a label only the API server sets).
    (operator,) = operator_rule["from"]
    assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}
    assert operator["podSelector"]["matchLabels"] == contract.OPERATOR_LABELS
    assert operator_rule["ports"] == [{"protocol": "TCP", "port": contract.METRICS_PORT}]
    # Every port any container of the job opens is admitted by a rule: nothing left open or forgotten.
    admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    opened = {p["containerPort"] for kind in ("StatefulSet", "Deployment")
              for c in children[kind]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    assert opened == admitted


def test_without_an_operator_namespace_the_policy_admits_the_operator_from_the_jobs() -> None:
    policy = next(c for c in rendered(spec.validate_job(example("digits-mlp.yaml")), image=IMAGE)
                  if c["kind"] == "NetworkPolicy")
    (operator,) = policy["spec"]["ingress"][1]["from"]
    assert list(operator) == ["podSelector"]


def test_the_network_policy_can_be_turned_off() -> None:
    doc = example("digits-mlp.yaml")
    doc["spec"]["parameterServers"]["networkPolicy"] = False
    assert "NetworkPolicy" not in {c["kind"] for c in rendered(spec.validate_job(doc), image=IMAGE)}


def test_a_data_volume_is_mounted_read_only_in_every_pod() -> None:
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["data"] = {"source": "npz:/data/train.npz", "volume": "training-data"}
    objects = rendered(spec.validate_job(doc), image="distbelief:test")
    for workload in (o for o in objects if o["kind"] in ("StatefulSet", "Deployment")):
        pod = workload["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "data"]
        assert volume["persistentVolumeClaim"] == {"claimName": "training-data", "readOnly": True}
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "data"]
        assert mount == {"name": "data", "mountPath": "/data", "readOnly": True}
        kubernetes_validate.validate(workload, K8S_VERSION, strict=True)
    plain = rendered(spec.validate_job(load_example("digits-mlp.yaml")), image="distbelief:test")
    assert not any(v["name"] == "data" for o in plain if o["kind"] == "Deployment"
                   for v in o["spec"]["template"]["spec"]["volumes"])


@pytest.mark.parametrize("data, fragment", [
    ({"source": "npz:/data/train.npz", "volume": "Training_Data"},
     "spec.data.volume: must be a PersistentVolumeClaim name"),
    ({"source": "npz:/mnt/train.npz", "volume": "training-data"},
     "spec.data.source: with spec.data.volume the files must be under /data/"),
])
def test_a_data_volume_is_validated(data: dict, fragment: str) -> None:
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["data"] = data
    with pytest.raises(errors.SpecError) as caught:
        spec.validate_job(doc)
    assert [line for line in caught.value.errors if fragment in line], caught.value.errors


# ------------------------------------------------------------- partitioned replicas


def partitioned(variant: str = "as-is", **spec_changes: Any) -> dict[str, Any]:
    doc = example("digits-partitioned.yaml")
    VARIANTS[variant](doc)
    doc["spec"]["workers"].update(spec_changes)
    return spec.validate_job(doc)


def workers_of(job: dict[str, Any], **options: Any) -> list[dict[str, Any]]:
    return [o for o in rendered(job, image=IMAGE, **options) if o["kind"] == "Deployment"]


def env_of(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c["env"]


def test_a_partitioned_job_has_one_worker_deployment_per_partition_with_every_replica() -> None:
    job = partitioned(variant="stored")
    objs = rendered(job, image=IMAGE)
    names = contract.JobNames("digits-partitioned")
    assert [o["kind"] for o in objs] == ["ConfigMap", "Service", "StatefulSet", "Deployment", "Deployment",
                                         "PodDisruptionBudget", "NetworkPolicy"]
    workers = [o for o in objs if o["kind"] == "Deployment"]
    assert [w["metadata"]["name"] for w in workers] == [names.worker_partition(0), names.worker_partition(1)] \
        == ["digits-partitioned-worker-p0", "digits-partitioned-worker-p1"]
    assert deployment.worker_deployment_names(spec.job_config(job)) == [w["metadata"]["name"] for w in workers]
    for k, worker in enumerate(workers):
        assert worker["spec"]["replicas"] == job["spec"]["workers"]["replicas"] == 3
        selector = worker["spec"]["selector"]["matchLabels"]
        assert selector == {**contract.selector_labels("digits-partitioned", contract.ROLE_WORKER),
                            podparts.PARTITION_LABEL: str(k)}
        assert selector.items() <= worker["spec"]["template"]["metadata"]["labels"].items()
        assert worker["metadata"]["labels"][podparts.PARTITION_LABEL] == str(k)
        assert worker["metadata"]["ownerReferences"][0]["uid"] == "6f1c-uid"
        kubernetes_validate.validate(worker, K8S_VERSION, strict=True)
    # The selectors do not overlap: no pod of one partition matches the other's Deployment.
    p0, p1 = (w["spec"]["template"]["metadata"]["labels"] for w in workers)
    assert not workers[1]["spec"]["selector"]["matchLabels"].items() <= p0.items()
    assert not workers[0]["spec"]["selector"]["matchLabels"].items() <= p1.items()
    # The scale subresource's selector (status.selector) still takes every partition's pods.
    assert all(contract.selector_labels("digits-partitioned", contract.ROLE_WORKER).items() <= labels.items()
               for labels in (p0, p1))


def test_each_partition_s_pods_know_their_partition_and_where_their_stage_serves() -> None:
    for k, worker in enumerate(workers_of(partitioned())):
        env = env_of(worker)
        names = [e["name"] for e in env]
        by_name = {e["name"]: e for e in env}
        assert by_name[contract.ENV_PARTITION] == {"name": contract.ENV_PARTITION, "value": str(k)}
        assert by_name[contract.ENV_POD_IP]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert by_name[contract.ENV_STAGE_ADDRESS]["value"] == f"tcp://$(POD_IP):{contract.STAGE_PORT}"
        # Kubernetes expands $(POD_IP) only from variables defined before it.
        assert names.index(contract.ENV_POD_IP) < names.index(contract.ENV_STAGE_ADDRESS)
        (c,) = worker["spec"]["template"]["spec"]["containers"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
            contract.METRICS_PORT_NAME: contract.METRICS_PORT, contract.STAGE_PORT_NAME: contract.STAGE_PORT}
        assert c["args"] == ["--config", contract.CONFIG_PATH, "--keys-dir", contract.KEYS_DIR]


def test_an_unpartitioned_job_s_replicas_get_no_partition_stage_or_label() -> None:
    (worker,) = workers_of(job_of())
    assert worker["metadata"]["name"] == "digits-worker"
    assert not {contract.ENV_PARTITION, contract.ENV_POD_IP, contract.ENV_STAGE_ADDRESS} & \
        {e["name"] for e in env_of(worker)}
    assert podparts.PARTITION_LABEL not in worker["spec"]["template"]["metadata"]["labels"]
    assert deployment.worker_deployment_names(spec.job_config(job_of())) == ["digits-worker"]


def test_partitioned_workers_mount_the_stage_keys_and_others_do_not() -> None:
    def items(worker: dict[str, Any]) -> list[str]:
        volume = {v["name"]: v for v in worker["spec"]["template"]["spec"]["volumes"]}[contract.KEYS_VOLUME]
        return [i["key"] for i in volume["secret"]["items"]]

    for worker in workers_of(partitioned()):
        assert items(worker) == [*keys.CLIENT_FILES, keys.STAGE_PUBLIC, keys.STAGE_SECRET]
        assert keys.SERVER_SECRET not in items(worker) and keys.CHIEF_SECRET not in items(worker)
    (plain,) = workers_of(job_of())
    assert items(plain) == list(keys.CLIENT_FILES)


def test_every_partition_follows_scaling_suspending_and_the_end_of_the_job() -> None:
    assert [w["spec"]["replicas"] for w in workers_of(partitioned(replicas=5))] == [5, 5]
    assert [w["spec"]["replicas"] for w in workers_of(partitioned("suspended"))] == [0, 0]
    assert [w["spec"]["replicas"] for w in workers_of(partitioned(), finished=True)] == [0, 0]
    hpa = children(partitioned("autoscaled"))["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "digits-partitioned"  # the job: all partitions at once
    hashes = {w["spec"]["template"]["metadata"]["annotations"][podparts.CONFIG_HASH_ANNOTATION]
              for w in workers_of(partitioned())}
    assert len(hashes) == 1


def test_a_partitioned_job_s_rendezvous_and_stages_admit_only_its_replica_pods() -> None:
    job = partitioned()
    objs = rendered(job, image=IMAGE, operator_namespace="ops")
    service = next(o for o in objs if o["kind"] == "Service")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}[contract.COORDINATOR_PORT_NAME] == \
        contract.COORDINATOR_PORT
    policy = next(o for o in objs if o["kind"] == "NetworkPolicy")
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    job_rule, operator_rule, stage_rule = policy["spec"]["ingress"]
    assert job_rule["ports"] == [{"protocol": "TCP", "port": job["spec"]["parameterServers"]["port"]},
                                 {"protocol": "TCP", "port": contract.BULK_PORT}]
    assert operator_rule["ports"] == [{"protocol": "TCP", "port": contract.METRICS_PORT}]
    (peers,) = stage_rule["from"]
    assert peers == {"podSelector": {"matchLabels": contract.selector_labels("digits-partitioned",
                                                                             contract.ROLE_WORKER)}}
    assert stage_rule["ports"] == [{"protocol": "TCP", "port": contract.COORDINATOR_PORT},
                                   {"protocol": "TCP", "port": contract.STAGE_PORT}]
    admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    opened = {p["containerPort"] for o in objs if o["kind"] in ("StatefulSet", "Deployment")
              for c in o["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    assert opened == admitted
def test_backups_give_each_shard_copy_its_own_pod_and_spread_them_over_nodes() -> None:
    doc = example("digits-mlp.yaml")
    doc["spec"]["parameterServers"]["backups"] = 1
    job = spec.validate_job(doc)
    objs = children(job)
    sts = objs["StatefulSet"]
    assert sts["spec"]["replicas"] == 4  # 2 shards x 2 copies, one volume claim each
    (term,) = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"labelSelector": {"matchLabels": contract.selector_labels("digits", "ps")},
                                       "topologyKey": "kubernetes.io/hostname"}
    for obj in objs.values():
        kubernetes_validate.validate(obj, "1.30", strict=True)
    config = spec.job_config(job)
    assert [config.copy_of(o) for o in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert config.copy_addresses({})[1] == ["tcp://digits-ps-1.digits-ps.default.svc:7070",
                                            "tcp://digits-ps-3.digits-ps.default.svc:7070"]
    plain = children(job_of())["StatefulSet"]
    assert plain["spec"]["replicas"] == 2 and "affinity" not in plain["spec"]["template"]["spec"]


def test_the_shards_disruption_budget_lets_one_pod_go_at_a_time() -> None:
    job = job_of(variant="stored")
    budget = children(job)["PodDisruptionBudget"]
    assert budget["metadata"]["name"] == "digits-ps"
    assert budget["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a crash-looping shard never blocks a drain
    assert budget["spec"]["selector"]["matchLabels"] == contract.selector_labels("digits", contract.ROLE_PS)


def test_the_liveness_probe_waits_for_data_and_checkpoint_loading() -> None:
    """A shard serves /healthz once it has loaded its data and restored its checkpoint: the
    startup probe gives it the time a restore of its slice takes on a slow disk (and data
    loading), so that the liveness probe does not kill a long restore in a loop."""
    def probes(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
        objs = children(spec.validate_job(doc))
        return {kind: objs[kind]["spec"]["template"]["spec"]["containers"][0] for kind in ("StatefulSet", "Deployment")}

    def budget(probe: dict[str, Any]) -> int:
        return probe["periodSeconds"] * probe["failureThreshold"]

    small = probes(example("digits-mlp.yaml"))
    for container in small.values():
        assert container["startupProbe"]["httpGet"] == container["livenessProbe"]["httpGet"]
        assert budget(container["startupProbe"]) >= sizing.STARTUP_SECONDS
    large_doc = example("digits-mlp.yaml")
    large_doc["spec"]["data"]["source"] = "synthetic:features=4096,classes=10,samples=1000"
    large_doc["spec"]["model"]["hiddenLayers"] = [4096, 4096, 4096]
    large = probes(large_doc)
    typed = spec.job_config(spec.validate_job(large_doc)).spec
    parameters = sizing.parameter_count(typed)
    shard_bytes = sizing.shard_bytes(typed, parameters)
    assert budget(large["StatefulSet"]["startupProbe"]) >= sizing.STARTUP_SECONDS + \
        shard_bytes / sizing.RESTORE_BYTES_PER_SECOND > budget(small["StatefulSet"]["startupProbe"])
    assert budget(large["Deployment"]["startupProbe"]) == budget(small["Deployment"]["startupProbe"])
    user = example("digits-mlp.yaml")
    user["spec"]["model"] = {"entrypoint": "my_pkg.models:build"}
    assert budget(probes(user)["StatefulSet"]["startupProbe"]) >= sizing.STARTUP_UNKNOWN_SECONDS


def test_the_checkpoint_claims_carry_the_uid_of_the_job_that_made_them() -> None:
    claim = children(job_of(variant="stored"))["StatefulSet"]["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["labels"][podparts.JOB_UID_LABEL] == "6f1c-uid"
    unstored = children(job_of())["StatefulSet"]["spec"]["volumeClaimTemplates"][0]
    assert podparts.JOB_UID_LABEL not in unstored["metadata"]["labels"]  # distbelief render: no job yet


def test_the_config_carries_the_jobs_uid_and_its_hash_leaves_it_out() -> None:
    """The shards record the uid in their checkpoints (a job of the same name never resumes
    another's); jobs made before the config carried it keep their pods on an upgrade."""
    import dataclasses
    import json

    stored = children(job_of(variant="stored"))
    assert json.loads(stored["ConfigMap"]["data"][contract.CONFIG_KEY])["uid"] == "6f1c-uid"
    assert "uid" not in json.loads(children(job_of())["ConfigMap"]["data"][contract.CONFIG_KEY])  # no job yet
    config = spec.job_config(job_of(variant="stored"))
    assert context.config_hash(config) == context.config_hash(dataclasses.replace(config, uid=None))


def test_backups_give_the_shard_pods_an_account_that_may_keep_their_view_leases_only() -> None:
    doc = example("digits-mlp.yaml")
    doc["spec"]["parameterServers"]["backups"] = 2
    objs = rendered(spec.validate_job(doc), image=IMAGE)
    kinds = [o["kind"] for o in objs]
    assert kinds.index("RoleBinding") < kinds.index("StatefulSet")  # the account exists before its pods
    account, role, binding = (next(o for o in objs if o["kind"] == k) for k in ("ServiceAccount", "Role", "RoleBinding"))
    assert account["metadata"]["name"] == role["metadata"]["name"] == binding["metadata"]["name"] == "digits-ps"
    assert account["automountServiceAccountToken"] is False
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": ["digits-shard-0", "digits-shard-1"], "verbs": ["get", "update"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "digits-ps"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "digits-ps", "namespace": "default"}]
    pod = next(o for o in objs if o["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "digits-ps" and pod["automountServiceAccountToken"] is False
    (token,) = [v for v in pod["volumes"] if "projected" in v]  # mounted in the shard container only
    sources = {next(iter(source)): source for source in token["projected"]["sources"]}
    assert 600 <= sources["serviceAccountToken"]["serviceAccountToken"]["expirationSeconds"] <= 86400
    assert sources["configMap"]["configMap"]["name"] == "kube-root-ca.crt"
    (shard,) = pod["containers"]
    (mount,) = [m for m in shard["volumeMounts"] if m["name"] == token["name"]]
    assert mount == {"name": token["name"], "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                     "readOnly": True}
    assert {"name": "DISTBELIEF_SERVICE_ACCOUNT_DIR", "value": mount["mountPath"]} in shard["env"]
    workers = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert "serviceAccountName" not in workers and workers["automountServiceAccountToken"] is False
    for obj in (account, role, binding):
        kubernetes_validate.validate(obj, "1.30", strict=True)
    assert not [o for o in rendered(job_of(), image=IMAGE) if o["kind"] in ("Role", "ServiceAccount")]
