"""The headless Service <job>-ps in front of the shard pods.
"""

from __future__ import annotations

from distbelief.operator.render import podparts
from distbelief.operator.render.context import RenderContext
from distbelief.runtime import contract


def render_ps_service(ctx: RenderContext) -> podparts.Manifest:
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
