"""The HorizontalPodAutoscaler <job>-worker, when the spec asks: it scales the DistBeliefJob
itself through its scale subresource.
"""

from __future__ import annotations

import copy

from distbelief.operator.render import podparts
from distbelief.operator.render.context import RenderContext
from distbelief.runtime import contract


def render_worker_hpa(ctx: RenderContext) -> podparts.Manifest | None:
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
