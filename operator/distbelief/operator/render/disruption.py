"""The PodDisruptionBudget <job>-ps: voluntary evictions take one shard pod at a time.
"""

from __future__ import annotations

from distbelief.operator.render import podparts
from distbelief.operator.render.context import RenderContext
from distbelief.runtime import contract


def render_ps_disruption_budget(ctx: RenderContext) -> podparts.Manifest:
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
