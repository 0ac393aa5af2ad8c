"""The replicas' Deployment <job>-worker, or with spec.model.partitions N > 1 one
Deployment <job>-worker-p<k> per partition, each with spec.workers.replicas pods (a
replica is one pod of each).
"""

from __future__ import annotations

from distbelief.operator.render import podparts, sizing
from distbelief.operator.render.context import RenderContext
from distbelief.runtime import contract


def worker_partitions(config: contract.JobConfig) -> list[int | None]:
    """One Deployment per partition; None for an unpartitioned job's one Deployment."""
    partitions = config.spec.model.partitions
    return [None] if partitions == 1 else list(range(partitions))


def deployment_name(config: contract.JobConfig, partition: int | None) -> str:
    return config.names.worker if partition is None else config.names.worker_partition(partition)


def worker_deployment_names(config: contract.JobConfig) -> list[str]:
    """The replicas' Deployments: <job>-worker, or <job>-worker-p<k> for each partition."""
    return [deployment_name(config, p) for p in worker_partitions(config)]


def render_worker_deployments(ctx: RenderContext) -> list[podparts.Manifest]:
    return [render_worker_deployment(ctx, p) for p in worker_partitions(ctx.config)]


def render_worker_deployment(ctx: RenderContext, partition: int | None = None) -> podparts.Manifest:
    """The replicas, or one partition's pods of every replica; spec.workers.replicas is kept
    even under autoscaling (the HPA scales the DistBeliefJob, whose scale subresource writes
    that field, and every partition follows it)."""
    ports, env, extra = [podparts.metrics_port()], [], {}
    name = deployment_name(ctx.config, partition)
    if partition is not None:
        ports.append(podparts.stage_port())
        env = podparts.stage_env(partition)
        extra = {podparts.PARTITION_LABEL: str(partition)}
    container = podparts.container(ctx, contract.ROLE_WORKER, args=["--keys-dir", contract.KEYS_DIR],
                                   startup_seconds=sizing.startup_seconds(ctx, contract.ROLE_WORKER), ports=ports, env=env)
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
            "template": podparts.role_pod_template(ctx, contract.ROLE_WORKER,
                                          podparts.pod_template(ctx, contract.ROLE_WORKER, container, extra)),
        },
    }
