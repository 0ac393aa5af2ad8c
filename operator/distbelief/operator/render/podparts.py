"""The parts every workload of a job shares: metadata and labels, the pod template and its
container, volumes (config, keys, checkpoints, data), probes, hardening and resources.

Pure functions of a RenderContext (context.py), as the renderer's are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from distbelief.operator.render import placement
from distbelief.operator.render.context import RenderContext
from distbelief.operator.validation.spec import DATA_DIR
from distbelief.runtime import contract, jobbase, jobspec, keys

Manifest = dict[str, Any]
APP_NAME = "distbelief"
MANAGED_BY = "distbelief-operator"
# What every child carries, and what the operator's watches select on the server.
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
CONFIG_HASH_ANNOTATION = f"{contract.API_GROUP}/config-hash"
RUN_AS_ID = 10001
TERMINATION_GRACE_SECONDS = 30
CONFIG_VOLUME = "config"
SCRATCH_VOLUME = "tmp"
# spec.data.volume's claim, read-only in every pod at DATA_DIR: npz:/data/... sources read from it.
DATA_VOLUME = "data"
# Owner-read only; with the pods' fsGroup the kubelet makes the files group-readable
# (0440, group 10001), which is what lets the non-root roles read them.
KEYS_MODE = 0o400
DEFAULT_CPU_UTILIZATION = 80
# A partitioned job's worker pods carry their partition's number (0..N-1) under this label,
# so that the partitions' Deployments select disjoint pods.
PARTITION_LABEL = f"{contract.API_GROUP}/partition"


def labels(job: str, component: str) -> dict[str, str]:
    """The labels of every object (and pod) of ``job`` playing ``component``."""
    return {
        "app.kubernetes.io/name": APP_NAME,
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/component": component,
        **MANAGED,
        **contract.selector_labels(job, component),
    }


def owner_references(ctx: RenderContext) -> list[dict[str, Any]]:
    """The job as controller of a child; none when the job has no uid (not stored yet)."""
    if not ctx.config.uid:
        return []
    return [{"apiVersion": contract.JOB_API_VERSION, "kind": contract.KIND, "name": ctx.config.name,
             "uid": ctx.config.uid, "controller": True, "blockOwnerDeletion": True}]


def metadata(ctx: RenderContext, name: str, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": ctx.config.namespace,
                            "labels": labels(ctx.config.name, component)}
    owners = owner_references(ctx)
    if owners:
        meta["ownerReferences"] = owners
    return meta


def pod_template(ctx: RenderContext, role: str, container: Manifest,
                 extra_labels: Mapping[str, str] | None = None, *, affinity: Manifest | None = None,
                 service_account: str | None = None) -> Manifest:
    """service_account: the pods run as it, with its token mounted (the shard copies keep
    their view Leases with it); otherwise they get no token at all."""
    template: Manifest = {
        "metadata": {
            "labels": {**labels(ctx.config.name, role), **(extra_labels or {})},
            "annotations": {CONFIG_HASH_ANNOTATION: ctx.config_hash},
        },
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
            "securityContext": pod_security(),
            "containers": [container],
            "volumes": [
                {"name": CONFIG_VOLUME, "configMap": {"name": ctx.names.config_map}},
                {"name": SCRATCH_VOLUME, "emptyDir": {}},
                keys_volume(ctx, role),
                *_data_volume(ctx),
            ],
        },
    }
    if affinity:
        template["spec"]["affinity"] = affinity
    if service_account:
        template["spec"]["serviceAccountName"] = service_account
        template["spec"]["volumes"].append(account_token_volume())
    return template


# The shard copies' ServiceAccount token, mounted where Kubernetes mounts one, but named in
# the pod (not left to the ServiceAccount admission plugin): only the shard container gets
# it, with a bounded lifetime the kubelet renews, and a node agent without that admission
# plugin (tools/local-node) makes the same volume.
ACCOUNT_TOKEN_VOLUME = contract.SERVICE_ACCOUNT_VOLUME
ACCOUNT_TOKEN_SECONDS = 3607


def account_token_volume() -> Manifest:
    return {"name": ACCOUNT_TOKEN_VOLUME, "projected": {"defaultMode": 0o444, "sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": ACCOUNT_TOKEN_SECONDS}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
    ]}}


def account_token_mount() -> tuple[list[Manifest], list[Manifest]]:
    """The shard container's (mounts, env) for account_token_volume(): the runtime finds the
    token through contract.ENV_SERVICE_ACCOUNT_DIR, which a node agent may move."""
    return ([{"name": ACCOUNT_TOKEN_VOLUME, "mountPath": contract.SERVICE_ACCOUNT_DIR, "readOnly": True}],
            [{"name": contract.ENV_SERVICE_ACCOUNT_DIR, "value": contract.SERVICE_ACCOUNT_DIR}])


def copies_account(ctx: RenderContext) -> str | None:
    """With backups, the shard pods' ServiceAccount (access.render_ps_access)."""
    return ctx.names.ps_access if ctx.spec.parameter_servers.copies > 1 else None


def spread_copies(ctx: RenderContext) -> Manifest | None:
    """With backups, the shard pods prefer distinct nodes, so that one node's loss takes at most
    one copy of a shard where the cluster has the room (preferred: a small cluster still runs
    the job). The pods of one StatefulSet share their labels, so all shard pods spread."""
    if ctx.spec.parameter_servers.copies == 1:
        return None
    term = {"labelSelector": {"matchLabels": contract.selector_labels(ctx.config.name, contract.ROLE_PS)},
            "topologyKey": "kubernetes.io/hostname"}
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": term}]}}


def object_store_env(data: jobspec.Data) -> list[dict[str, Any]]:
    """An s3:// source's credentials, from the Secret spec.data.objectStore.secretRef names
    (its keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY): never in the ConfigMap."""
    secret = data.object_store.secret_ref if data.object_store else None
    if not secret:
        return []
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
            for key in contract.OBJECT_STORE_KEYS]


def container(ctx: RenderContext, role: str, *, args: list[str], startup_seconds: int,
              ports: list[dict[str, Any]], mounts: list[dict[str, Any]] | None = None,
              env: list[dict[str, Any]] | None = None) -> Manifest:
    """The one container of a role's pods: ``distbelief <role> --config ... <args>``; env
    comes after the common variables (and may refer to them as $(NAME)). The liveness
    probe starts counting once the role serves, or after startup_seconds (startup_probe)."""
    container: Manifest = {
        "name": role,
        "image": ctx.image,
        "command": ["distbelief", role],
        "args": ["--config", contract.CONFIG_PATH, *args],
        "env": [{"name": contract.ENV_POD_NAME,
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                *({"name": k, "value": v} for k, v in contract.ROLE_ENV.items()),
                *_thread_env(role_spec(ctx, role).resources),
                *object_store_env(ctx.spec.data),
                *(env or [])],
        "ports": ports,
        "startupProbe": startup_probe(startup_seconds),
        "livenessProbe": _probe(contract.HEALTH_PATH, period=10, failures=3),
        "readinessProbe": _probe(contract.READY_PATH, period=5, failures=1),
        "securityContext": container_security(),
        # A role's one-line error (the tail of its log) becomes the terminated state's
        # message, which the operator quotes when a config error fails the job.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": CONFIG_VOLUME, "mountPath": contract.CONFIG_DIR, "readOnly": True},
            {"name": SCRATCH_VOLUME, "mountPath": contract.SCRATCH_DIR},
            {"name": contract.KEYS_VOLUME, "mountPath": contract.KEYS_DIR, "readOnly": True},
            *_data_mount(ctx),
            *(mounts or []),
        ],
    }
    limits = resources(role_spec(ctx, role).resources)
    if limits:
        container["resources"] = limits
    return container


def role_spec(ctx: RenderContext, role: str) -> jobspec.ParameterServers | jobspec.Workers:
    """The section of the spec that sizes and templates a role's pods."""
    return ctx.spec.parameter_servers if role == contract.ROLE_PS else ctx.spec.workers


def _data_volume(ctx: RenderContext) -> list[dict[str, Any]]:
    """spec.data.volume: the user's claim (npz files), read-only in every pod; none without it."""
    claim = ctx.spec.data.volume
    return [{"name": DATA_VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}] if claim else []


def _data_mount(ctx: RenderContext) -> list[dict[str, Any]]:
    return [{"name": DATA_VOLUME, "mountPath": DATA_DIR, "readOnly": True}] if ctx.spec.data.volume else []


def keys_volume(ctx: RenderContext, role: str) -> dict[str, Any]:
    """The job's keys: all of them for the shards (shard 0's chief is a client too),
    never the server's secret for a replica; a partitioned job's replica pods also get the
    stages' keypair (each serves its stage). Not optional: a pod waits for the Secret
    rather than run unauthenticated."""
    secret: dict[str, Any] = {"secretName": ctx.names.keys_secret, "defaultMode": KEYS_MODE}
    if role == contract.ROLE_WORKER:
        files = keys.CLIENT_FILES + (keys.STAGE_FILES if ctx.spec.model.partitions > 1 else ())
        secret["items"] = [{"key": name, "path": name} for name in files]
    return {"name": contract.KEYS_VOLUME, "secret": secret}


# A role serves /healthz only once it has loaded its data and built its model, and a shard
# once it has restored its checkpoint: until then the kubelet asks every STARTUP_PERIOD
# seconds, and the liveness probe (3 misses 10 s apart) waits.
STARTUP_PERIOD = 10


def startup_probe(seconds: int) -> dict[str, Any]:
    """Up to seconds (rounded up to the period) for a role to start serving /healthz."""
    return _probe(contract.HEALTH_PATH, period=STARTUP_PERIOD, failures=max(1, math.ceil(seconds / STARTUP_PERIOD)))


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": contract.METRICS_PORT_NAME},
            "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": 2}


def pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_ID, "runAsGroup": RUN_AS_ID,
            "fsGroup": RUN_AS_ID, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


# BLAS and OpenMP size their thread pools by the node's cores, not the pod's share: on a
# shared node, replicas and shards then spin against each other (2.8x fewer examples/s,
# measured with 4 pods on 2 cores). Each pod gets as many threads as it has CPUs.
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
def _thread_env(resources: Mapping[str, Any] | None) -> list[dict[str, str]]:
    """Threads = the CPU limit, else the CPU request, rounded up; nothing set without either."""
    cpus = next((quantities["cpu"] for key in ("limits", "requests")
                 if (quantities := (resources or {}).get(key)) and "cpu" in quantities), None)
    if cpus is None:
        return []
    threads = str(max(1, math.ceil(cpu_cores(cpus))))
    return [{"name": name, "value": threads} for name in THREAD_ENV]


def cpu_cores(quantity: str | int | float) -> Decimal:
    """A Kubernetes quantity ("500m", "2", "1.5", 2 CPUs; "1Gi", "512M", "1e9" bytes) as a number."""
    return jobbase.quantity(quantity)


def resources(requirements: Mapping[str, Any] | None) -> dict[str, Any]:
    return {key: dict(requirements[key]) for key in ("requests", "limits") if requirements and requirements.get(key)}


def metrics_port() -> dict[str, Any]:
    return {"name": contract.METRICS_PORT_NAME, "containerPort": contract.METRICS_PORT,
            "protocol": "TCP"}


def ps_ports(ctx: RenderContext) -> list[dict[str, Any]]:
    """The shard port and metrics; with encryption the bulk port; under Sandblaster also the
    coordinator's, in a partitioned job the rendezvous's, and when the replicas stream a
    file source the data dispenser's, on the same port (shard 0 serves one of them)."""
    spec = ctx.spec
    ports = [{"name": contract.SHARD_PORT_NAME, "containerPort": spec.parameter_servers.port, "protocol": "TCP"},
             metrics_port()]
    if spec.parameter_servers.encryption:
        ports.append({"name": contract.BULK_PORT_NAME, "containerPort": contract.BULK_PORT, "protocol": "TCP"})
    if spec.training.algorithm == "sandblaster" or spec.model.partitions > 1 or spec.streams_data:
        ports.append({"name": contract.COORDINATOR_PORT_NAME, "containerPort": contract.COORDINATOR_PORT,
                      "protocol": "TCP"})
    return ports


def stage_port() -> dict[str, Any]:
    return {"name": contract.STAGE_PORT_NAME, "containerPort": contract.STAGE_PORT, "protocol": "TCP"}


def stage_env(partition: int) -> list[dict[str, Any]]:
    """A partitioned job's worker pod: its partition, and where its stage serves, as its
    group's other pods reach it (the kubelet expands $(POD_IP), defined just before)."""
    return [{"name": contract.ENV_PARTITION, "value": str(partition)},
            {"name": contract.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": contract.ENV_STAGE_ADDRESS, "value": f"tcp://$({contract.ENV_POD_IP}):{contract.STAGE_PORT}"}]


# On the checkpoint claims (from the claim template): the uid of the job that made them, which
# tells them apart from the claims a deleted job of the same name left behind.
JOB_UID_LABEL = f"{contract.API_GROUP}/job-uid"


def checkpoint_claim(ctx: RenderContext, storage: jobspec.Storage) -> Manifest:
    claim_labels = labels(ctx.config.name, contract.ROLE_PS)
    if ctx.config.uid:
        claim_labels[JOB_UID_LABEL] = ctx.config.uid
    claim: Manifest = {
        "metadata": {"name": contract.CHECKPOINT_VOLUME, "labels": claim_labels},
        "spec": {"accessModes": ["ReadWriteOnce"],
                 "resources": {"requests": {"storage": storage.size}}},
    }
    if storage.storage_class_name:
        claim["spec"]["storageClassName"] = storage.storage_class_name
    return claim


def cpu_metric() -> dict[str, Any]:
    return {"type": "Resource",
            "resource": {"name": "cpu", "target": {"type": "Utilization",
                                                   "averageUtilization": DEFAULT_CPU_UTILIZATION}}}


def role_pod_template(ctx: RenderContext, role: str, rendered: Manifest) -> Manifest:
    """The rendered pod template with the role's spec template and the job's pull secrets."""
    merged = placement.apply_template(rendered, role_spec(ctx, role).template, ctx.spec.image_pull_secrets)
    admitted = (ctx.placement or {}).get(role)
    if admitted:
        merged = placement.add_placement(merged, admitted.get("nodeSelector") or {}, admitted.get("tolerations") or [])
    return merged
