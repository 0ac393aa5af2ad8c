"""The NetworkPolicy <job>-ps around all the job's pods, unless the spec turns it off.
"""

from __future__ import annotations

from typing import Any

from distbelief.operator.render import podparts
from distbelief.operator.render.context import RenderContext
from distbelief.runtime import contract

# Set by the API server on every namespace, and only by it: a selector users cannot fake.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def render_ps_network_policy(ctx: RenderContext) -> podparts.Manifest | None:
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
