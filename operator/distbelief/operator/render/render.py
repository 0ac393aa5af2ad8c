"""Render a validated DistBeliefJob into the Kubernetes objects that run it.

Pure functions: the output of :func:`distbelief.operator.spec.spec.validate_job` in, plain
manifest dicts out, no cluster access and no kopf or kubernetes imports. The operator
applies what these return, ``distbelief render`` prints it and local mode runs the
containers' commands, so there is exactly one renderer.

Children, in order: ConfigMap ``<job>-config`` (the resolved config), headless Service
``<job>-ps``, with backups the ServiceAccount, Role and RoleBinding ``<job>-ps`` (the
shard copies keep their view in Leases ``<job>-shard-<i>``), StatefulSet ``<job>-ps``
(one pod and one checkpoint volume per shard copy: pod o is copy o // shards of shard
o % shards), Deployment ``<job>-worker`` (the model replicas;
with spec.model.partitions N > 1, one Deployment ``<job>-worker-p<k>`` per partition
instead, each with spec.workers.replicas pods, so that a replica is one pod of each), the
PodDisruptionBudget ``<job>-ps`` (voluntary evictions take one shard pod at a time; local
mode has no use for it) and, when the spec asks, a HorizontalPodAutoscaler
``<job>-worker`` that scales the DistBeliefJob itself through its scale subresource, and,
unless the spec turns it off, the NetworkPolicy ``<job>-ps`` around all the job's pods.

Every pod mounts the Secret ``<job>-keys`` (the job's CurveZMQ keys) read-only. That
Secret is not among the children: it holds key material that must be made once and
never rewritten, so the operator creates it from :func:`render_keys_secret` only when it
is absent, and local mode writes the same files into its output folder.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from distbelief.operator.render import placement, podparts, queue, sizing
from distbelief.operator.render.context import RenderContext
from distbelief.operator.spec.job import DistBeliefJob
from distbelief.runtime import contract

log = logging.getLogger(__name__)

JOB_UID_LABEL = podparts.JOB_UID_LABEL
COMPONENT_CONFIG = "config"
COMPONENT_KEYS = "keys"
# The image the roles run when neither the job nor the operator's settings name one.
DEFAULT_IMAGE = "distbelief/distbelief:0.1.0"
# Set by the API server on every namespace, and only by it: a selector users cannot fake.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"

Manifest = podparts.Manifest


def render_children(job: DistBeliefJob, *, image: str, finished: bool = False, held: bool = False,
                    operator_namespace: str | None = None) -> list[Manifest]:
    """Every child object of ``job``, in the order they should be applied.

    A finished job keeps its objects but runs no replicas (and no shards, unless
    runPolicy.cleanPodPolicy is None) and no autoscaler; nor does one its queue holds.
    operator_namespace is where the operator that reads the job's metrics runs (the
    NetworkPolicy admits it)."""
    ctx = RenderContext.of(job, image=image, finished=finished, held=held, operator_namespace=operator_namespace)
    children = [
        render_config_map(ctx),
        render_ps_service(ctx),
        *render_ps_access(ctx),
        render_ps_statefulset(ctx),
        *render_worker_deployments(ctx),
        render_ps_disruption_budget(ctx),
    ]
    children += [c for c in (render_worker_hpa(ctx), render_ps_network_policy(ctx)) if c is not None]
    log.debug("rendered job=%s children=%d hash=%s", ctx.config.name, len(children),
              ctx.config_hash)
    return children


def to_yaml(objs: Iterable[Mapping[str, Any]]) -> str:
    """Multi-document YAML, keys in the order they were built, multi-line text as blocks."""
    return yaml.dump_all([_plain(o) for o in objs], Dumper=_BlockDumper, sort_keys=False,
                         explicit_start=True, default_flow_style=False, allow_unicode=True)


# ------------------------------------------------------------------- the children


def render_keys_secret(job: DistBeliefJob, files: Mapping[str, str]) -> Manifest:
    """The Secret ``<job>-keys`` holding ``files`` (distbelief.runtime.keys.JobKeys.files()).

    Immutable: the API server refuses any change to it, so keys are never rotated by a
    patch; rotating means deleting it and restarting the job's pods."""
    ctx = RenderContext.of(job, image=DEFAULT_IMAGE)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": podparts.metadata(ctx, ctx.names.keys_secret, COMPONENT_KEYS),
        "type": "Opaque",
        "immutable": True,
        "data": {name: base64.b64encode(text.encode("ascii")).decode("ascii")
                 for name, text in sorted(files.items())},
    }


def render_config_map(ctx: RenderContext) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": podparts.metadata(ctx, ctx.names.config_map, COMPONENT_CONFIG),
        "data": {contract.CONFIG_KEY: ctx.config_json},
    }


def render_ps_service(ctx: RenderContext) -> Manifest:
    """Headless: every shard pod gets a stable DNS name, ready or not."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": podparts.metadata(ctx, ctx.names.ps, contract.ROLE_PS),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": contract.selector_labels(ctx.config.name, contract.ROLE_PS),
            "ports": [
                {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"],
                 "protocol": "TCP"}
                for p in podparts.ps_ports(ctx)
            ],
        },
    }


def render_ps_statefulset(ctx: RenderContext) -> Manifest:
    storage = ctx.spec.parameter_servers.checkpoint.storage
    account = podparts.copies_account(ctx)
    token_mounts, token_env = podparts.account_token_mount() if account else ([], [])
    container = podparts.container(
        ctx, contract.ROLE_PS, startup_seconds=startup_seconds(ctx, contract.ROLE_PS),
        args=["--checkpoint-dir", contract.CHECKPOINT_DIR, "--keys-dir", contract.KEYS_DIR],
        ports=podparts.ps_ports(ctx),
        mounts=[{"name": contract.CHECKPOINT_VOLUME, "mountPath": contract.CHECKPOINT_DIR}, *token_mounts],
        env=token_env,
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": podparts.metadata(ctx, ctx.names.ps, contract.ROLE_PS),
        "spec": {
            "serviceName": ctx.names.ps,
            "replicas": ctx.shard_replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": contract.selector_labels(ctx.config.name,
                                                                 contract.ROLE_PS)},
            "persistentVolumeClaimRetentionPolicy": {
                "whenDeleted": storage.retention, "whenScaled": "Retain"},
            "template": role_pod_template(ctx, contract.ROLE_PS, podparts.pod_template(
                ctx, contract.ROLE_PS, container, affinity=podparts.spread_copies(ctx), service_account=account)),
            "volumeClaimTemplates": [podparts.checkpoint_claim(ctx, storage)],
        },
    }


def role_pod_template(ctx: RenderContext, role: str, rendered: Manifest) -> Manifest:
    """The rendered pod template with the role's spec template and the job's pull secrets."""
    merged = placement.apply_template(rendered, podparts.role_spec(ctx, role).template, ctx.spec.image_pull_secrets)
    admitted = (ctx.placement or {}).get(role)
    if admitted:
        merged = placement.add_placement(merged, admitted.get("nodeSelector") or {}, admitted.get("tolerations") or [])
    return merged


def render_workload(job: DistBeliefJob, *, image: str) -> Manifest:
    """The Kueue Workload of a job labelled with a queue (render/queue.py): its podSets carry
    the roles' pod templates as the job runs them before any admission."""
    ctx = RenderContext.of(dataclasses.replace(job, annotations={}), image=image)
    templates = {contract.ROLE_PS: render_ps_statefulset(ctx)["spec"]["template"],
                 contract.ROLE_WORKER: render_worker_deployment(ctx, _worker_partitions(ctx.config)[0])["spec"]["template"]}
    return queue.render_workload(job, ctx, templates)


# How long a role may take to start serving: loading the data and building the model (a
# built-in or synthetic source whose size the spec tells: STARTUP_SECONDS; npz files, user
# code or embeddings, whose size only loading tells: STARTUP_UNKNOWN_SECONDS), and for a
# shard also reading its checkpoint, at RESTORE_BYTES_PER_SECOND (a slow network disk).
STARTUP_SECONDS = 300
STARTUP_UNKNOWN_SECONDS = 900
RESTORE_BYTES_PER_SECOND = 20 * 2 ** 20


def startup_seconds(ctx: RenderContext, role: str) -> int:
    """The startup probe's budget for a role's pods (see STARTUP_SECONDS)."""
    parameters = None if ctx.spec.model.embeddings else sizing.parameter_count(ctx.spec)
    if parameters is None:
        return STARTUP_UNKNOWN_SECONDS
    if role != contract.ROLE_PS:
        return STARTUP_SECONDS
    checkpoint = sizing.shard_bytes(ctx.spec, parameters)
    return STARTUP_SECONDS + -(-checkpoint // RESTORE_BYTES_PER_SECOND)


def render_ps_disruption_budget(ctx: RenderContext) -> Manifest:
    """At most one shard pod evicted at a time (a node drain, a cluster upgrade): without
    backups a shard's loss pauses training until it restarts from its checkpoint, and with
    them one copy at a time may go. A pod that is not ready may always be evicted, so a
    crash-looping shard never blocks a drain."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": podparts.metadata(ctx, ctx.names.ps, contract.ROLE_PS),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": contract.selector_labels(ctx.config.name, contract.ROLE_PS)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


RBAC_API = "rbac.authorization.k8s.io"


def render_ps_access(ctx: RenderContext) -> list[Manifest]:
    """With backups: the shard pods' ServiceAccount, and the Role and RoleBinding that let it
    keep each shard's view in a Lease (runtime shard/copies/kubelease.py): get and update the
    job's Leases by name, and create (which no name can restrict). Nothing without backups:
    the pods then get no token at all."""
    account = podparts.copies_account(ctx)
    if account is None:
        return []
    leases = [ctx.names.shard_lease(i) for i in range(ctx.spec.parameter_servers.shards)]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": podparts.metadata(ctx, account, contract.ROLE_PS),
         "automountServiceAccountToken": False},  # only the pods that ask for it (the shards) mount it
        {"apiVersion": f"{RBAC_API}/v1", "kind": "Role",
         "metadata": podparts.metadata(ctx, account, contract.ROLE_PS),
         "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
                   {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": leases,
                    "verbs": ["get", "update"]}]},
        {"apiVersion": f"{RBAC_API}/v1", "kind": "RoleBinding",
         "metadata": podparts.metadata(ctx, account, contract.ROLE_PS),
         "roleRef": {"apiGroup": RBAC_API, "kind": "Role", "name": account},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ctx.config.namespace}]},
    ]


def _worker_partitions(config: contract.JobConfig) -> list[int | None]:
    """One Deployment per partition; None for an unpartitioned job's one Deployment."""
    partitions = config.spec.model.partitions
    return [None] if partitions == 1 else list(range(partitions))


def _worker_deployment_name(config: contract.JobConfig, partition: int | None) -> str:
    return config.names.worker if partition is None else config.names.worker_partition(partition)


def worker_deployment_names(config: contract.JobConfig) -> list[str]:
    """The replicas' Deployments: <job>-worker, or <job>-worker-p<k> for each partition."""
    return [_worker_deployment_name(config, p) for p in _worker_partitions(config)]


def render_worker_deployments(ctx: RenderContext) -> list[Manifest]:
    return [render_worker_deployment(ctx, p) for p in _worker_partitions(ctx.config)]


def render_worker_deployment(ctx: RenderContext, partition: int | None = None) -> Manifest:
    """The replicas, or one partition's pods of every replica; spec.workers.replicas is kept
    even under autoscaling (the HPA scales the DistBeliefJob, whose scale subresource writes
    that field, and every partition follows it)."""
    ports, env, extra = [podparts.metrics_port()], [], {}
    name = _worker_deployment_name(ctx.config, partition)
    if partition is not None:
        ports.append(podparts.stage_port())
        env = podparts.stage_env(partition)
        extra = {podparts.PARTITION_LABEL: str(partition)}
    container = podparts.container(ctx, contract.ROLE_WORKER, args=["--keys-dir", contract.KEYS_DIR],
                                   startup_seconds=startup_seconds(ctx, contract.ROLE_WORKER), ports=ports, env=env)
    metadata = podparts.metadata(ctx, name, contract.ROLE_WORKER)
    metadata["labels"].update(extra)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": ctx.worker_replicas,
            "selector": {"matchLabels": {**contract.selector_labels(ctx.config.name, contract.ROLE_WORKER),
                                         **extra}},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}},
            "template": role_pod_template(ctx, contract.ROLE_WORKER,
                                          podparts.pod_template(ctx, contract.ROLE_WORKER, container, extra)),
        },
    }


def render_ps_network_policy(ctx: RenderContext) -> Manifest | None:
    """Unless the spec turns it off: every pod of the job (shards, chief, coordinator,
    replicas) admits its ZeroMQ ports only from the job's own pods in its namespace, and
    its metrics port only from the operator's pods in the operator's namespace; in a
    partitioned job, the rendezvous's and the stages' ports only from the job's replica
    pods. Every other port of those pods, and every other peer, is refused. (Named
    <job>-ps, as when it covered the shards alone, so an upgrade replaces it rather than
    adds one.)"""
    if not ctx.spec.parameter_servers.network_policy:
        return None
    job = {contract.LABEL_JOB: ctx.config.name}
    operator: dict[str, Any] = {"podSelector": {"matchLabels": dict(contract.OPERATOR_LABELS)}}
    if ctx.operator_namespace:  # else the operator is taken to run in the job's namespace
        operator["namespaceSelector"] = {"matchLabels": {NAMESPACE_NAME_LABEL: ctx.operator_namespace}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": podparts.metadata(ctx, ctx.names.ps, contract.ROLE_PS),
        "spec": {
            "podSelector": {"matchLabels": job},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": job}}],
                 "ports": [{"protocol": "TCP", "port": p["containerPort"]} for p in podparts.ps_ports(ctx)
                           if p["name"] not in (contract.METRICS_PORT_NAME, *_replica_only_ports(ctx))]},
                {"from": [operator], "ports": [{"protocol": "TCP", "port": contract.METRICS_PORT}]},
                *_stage_ingress(ctx),
            ],
        },
    }


def _replica_only_ports(ctx: RenderContext) -> tuple[str, ...]:
    """Ports only the replicas' pods reach: a partitioned job's rendezvous beside shard 0."""
    return (contract.COORDINATOR_PORT_NAME,) if ctx.spec.model.partitions > 1 else ()


def _stage_ingress(ctx: RenderContext) -> list[dict[str, Any]]:
    """A partitioned job's replica pods reach the rendezvous and each other's stages."""
    if ctx.spec.model.partitions == 1:
        return []
    replicas = {"podSelector": {"matchLabels": contract.selector_labels(ctx.config.name, contract.ROLE_WORKER)}}
    return [{"from": [replicas], "ports": [{"protocol": "TCP", "port": contract.COORDINATOR_PORT},
                                           {"protocol": "TCP", "port": contract.STAGE_PORT}]}]


def render_worker_hpa(ctx: RenderContext) -> Manifest | None:
    """An autoscaling/v2 HPA on the job's scale subresource, if the spec asks for one
    and the job is running (an autoscaler must not revive a suspended or finished job)."""
    autoscaling = ctx.spec.workers.autoscaling
    if not autoscaling or ctx.suspended or ctx.finished:
        return None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": podparts.metadata(ctx, ctx.names.worker, contract.ROLE_WORKER),
        "spec": {
            "scaleTargetRef": {"apiVersion": contract.JOB_API_VERSION, "kind": contract.KIND,
                               "name": ctx.config.name},
            "minReplicas": autoscaling.min_replicas,
            "maxReplicas": autoscaling.max_replicas,
            "metrics": copy.deepcopy(list(autoscaling.metrics or [])) or [podparts.cpu_metric()],
            **({"behavior": copy.deepcopy(dict(autoscaling.behavior))} if autoscaling.behavior else {}),
        },
    }


# ------------------------------------------------------------------------- YAML


class _BlockDumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings (the config JSON) as literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_BlockDumper.add_representer(str, _represent_str)


def _plain(obj: Any) -> Any:
    """A JSON round trip: plain dicts and lists only, whatever mappings came in."""
    return json.loads(json.dumps(obj))
