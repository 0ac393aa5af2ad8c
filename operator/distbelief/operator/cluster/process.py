"""The operator process: every kopf handler registered, then kopf runs until stopped.

Importing handlers (the job's) and childwatch (its children's) registers their kopf
handlers; childwatch builds on handlers, so the process, not handlers, brings both in.
"""

from __future__ import annotations

import kopf

from distbelief.operator.cluster import childwatch, handlers  # noqa: F401  (importing registers them)
from distbelief.operator.cluster import metrics as operator_metrics


def run(*, namespaces: list[str], standalone: bool, liveness: str | None, peering: str,
        metrics: tuple[str, int] | None = None) -> None:
    """Run the operator until it is stopped (SIGTERM/SIGINT); with metrics (host, port), serve
    its own metrics there from the start."""
    if metrics:
        operator_metrics.serve(*metrics)
    peering_name = None if standalone else peering
    kopf.run(clusterwide=not namespaces, namespaces=namespaces, standalone=standalone,
             liveness_endpoint=liveness, peering_name=peering_name,
             memo=kopf.Memo(peering=peering_name, namespaces=list(namespaces)))
