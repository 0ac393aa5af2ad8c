"""The ConfigMap <job>-config: the resolved config every role reads.
"""

from __future__ import annotations

from distbelief.operator.render import podparts
from distbelief.operator.render.context import RenderContext
from distbelief.runtime import contract

COMPONENT_CONFIG = "config"


def render_config_map(ctx: RenderContext) -> podparts.Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": podparts.metadata(ctx, ctx.names.config_map, COMPONENT_CONFIG),
        "data": {contract.CONFIG_KEY: ctx.config_json},
    }
