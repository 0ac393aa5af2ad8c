"""A job in a Kueue queue: the Workload that represents it, and the placement an admission
gives its pods.

A job labelled kueue.x-k8s.io/queue-name is represented by a Workload of its own (Kueue's
"external framework" contract): one podSet per role, shards x copies shard pods and
replicas x partitions replica pods, each with the role's pod template (its requests are
what Kueue counts against the queue's quota). The operator keeps the job suspended until
Kueue admits the Workload, and then records the admission's node selectors and tolerations
(from the assigned ResourceFlavors) in the job's ADMISSION_ANNOTATION; the renderer merges
them onto the role's pods. Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distbelief.operator.render import podparts
from distbelief.operator.render.context import ADMISSION_ANNOTATION, RenderContext
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
WORKLOAD_API_VERSION = "kueue.x-k8s.io/v1beta1"
# ADMISSION_ANNOTATION (context.py): the placement Kueue's admission gave the job's pods, by
# role, as JSON: {"ps": {"nodeSelector": {...}, "tolerations": [...]}, "worker": {...}}.
# Present while the job runs under an admission; removed when an eviction withdraws it.
__all__ = ["ADMISSION_ANNOTATION", "QUEUE_LABEL", "queue_name", "held", "render_workload", "placement_of"]
POD_SETS = (contract.ROLE_PS, contract.ROLE_WORKER)

Manifest = dict[str, Any]


def queue_name(job: DistBeliefJob) -> str | None:
    return job.labels.get(QUEUE_LABEL) or None


def held(job: DistBeliefJob) -> bool:
    """Whether the job's queue holds it: labelled with a queue, and not started under an
    admission (the operator renders it suspended)."""
    return queue_name(job) is not None and ADMISSION_ANNOTATION not in job.annotations


def workload_name(job: str) -> str:
    return f"{contract.KIND.lower()}-{job}"


def render_workload(job: DistBeliefJob, ctx: RenderContext, pod_templates: Mapping[str, Manifest]) -> Manifest:
    """The job's Workload: queue, priority class (the replicas' template's), and one podSet
    per role with the role's pod template as the job runs it (before any admission)."""
    servers = ctx.spec.parameter_servers
    counts = {contract.ROLE_PS: servers.shards * servers.copies,
              contract.ROLE_WORKER: ctx.spec.workers.replicas * ctx.spec.model.partitions}
    spec: Manifest = {
        "queueName": queue_name(job),
        "podSets": [{"name": role, "count": counts[role], "template": pod_templates[role]} for role in POD_SETS],
    }
    priority = ((ctx.spec.workers.template or {}).get("spec") or {}).get("priorityClassName")
    if priority:
        spec["priorityClassName"] = priority
    return {
        "apiVersion": WORKLOAD_API_VERSION,
        "kind": "Workload",
        "metadata": podparts.metadata(ctx, workload_name(ctx.config.name), "workload"),
        "spec": spec,
    }


def placement_of(admission: Mapping[str, Any], flavors: Mapping[str, Mapping[str, Any]],
                 checks: list[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """role -> {nodeSelector, tolerations}: for each podSet the union of the node labels and
    tolerations of the ResourceFlavors its resources were assigned (flavors: name -> object),
    then those of the admission checks' podSetUpdates for it (status.admissionChecks)."""
    placement: dict[str, Any] = {}
    for assignment in admission.get("podSetAssignments") or []:
        names = sorted(set((assignment.get("flavors") or {}).values()))
        sources = [(flavors.get(n) or {}).get("spec") or {} for n in names]
        sources = [{"nodeSelector": f.get("nodeLabels"), "tolerations": f.get("tolerations")} for f in sources]
        sources += [update for check in checks or [] for update in check.get("podSetUpdates") or []
                    if update.get("name") == assignment["name"]]
        selector: dict[str, str] = {}
        tolerations: list[Any] = []
        for source in sources:
            selector.update(source.get("nodeSelector") or {})
            tolerations += [t for t in source.get("tolerations") or [] if t not in tolerations]
        placement[assignment["name"]] = {"nodeSelector": selector, "tolerations": tolerations}
    return placement
