"""The StatefulSet <job>-ps: one pod and one checkpoint volume per shard copy (pod o is
copy o // shards of shard o % shards).
"""

from __future__ import annotations

from distbelief.operator.render import podparts, sizing
from distbelief.operator.render.context import RenderContext
from distbelief.runtime import contract


def render_ps_statefulset(ctx: RenderContext) -> podparts.Manifest:
    storage = ctx.spec.parameter_servers.checkpoint.storage
    account = podparts.copies_account(ctx)
    token_mounts, token_env = podparts.account_token_mount() if account else ([], [])
    container = podparts.container(
        ctx, contract.ROLE_PS, startup_seconds=sizing.startup_seconds(ctx, contract.ROLE_PS),
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
            "template": podparts.role_pod_template(ctx, contract.ROLE_PS, podparts.pod_template(
                ctx, contract.ROLE_PS, container, affinity=podparts.spread_copies(ctx), service_account=account)),
            "volumeClaimTemplates": [podparts.checkpoint_claim(ctx, storage)],
        },
    }
