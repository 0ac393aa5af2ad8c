"""A job's children on the cluster: applied where the job owns them, put back when changed.

    apply_all(kube, job)          every rendered child created or patched; optional children the
                                  spec no longer asks for (HPA, NetworkPolicy) deleted
    drifted(job, child)           whether a child a watch saw (or saw go) no longer matches the job
    put_back(kube, job, child)    such a child recreated, patched back, or deleted
    stale_claims(kube, job)       checkpoint claims of another job of the same name

The job owns a child when the job is its controller (the owner reference with
`controller: true` and the job's uid). An object of a child's name that the job does not
own is someone else's: it is never patched or deleted, and nothing is created in its
place; the job reports it (`foreign`) and waits. Pure decisions on top of kube.py's
calls; the kopf handlers (handlers.py) report what these return.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from typing import Any

from distbelief.operator.cluster.kube import Kube, Manifest, contains, controller_uid, mutable_part
from distbelief.operator.render import kinds, podparts
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract

log = logging.getLogger(__name__)

# The label the StatefulSet copies from its claim template to every checkpoint claim.
JOB_UID_LABEL = podparts.JOB_UID_LABEL


@dataclasses.dataclass
class Applied:
    """What apply_all did: a result per child ("Kind/name" -> created|patched|unchanged|
    deleted), and the children whose name someone else's object holds."""

    results: dict[str, str]
    foreign: list[str]

    @property
    def changed(self) -> dict[str, str]:
        return {name: result for name, result in self.results.items() if result not in ("unchanged", "foreign")}


def apply_all(kube: Kube, job: DistBeliefJob, children: list[Manifest], *, new: bool = False) -> Applied:
    """Create (a new job's: without reading first) or patch every child; delete an optional
    child that the spec no longer asks for. The removal runs for a new job too: a retried
    create may have left one. Only the job's own objects are changed."""
    applied = Applied({}, [])
    for child in children:
        key = f"{child['kind']}/{child['metadata']['name']}"
        applied.results[key] = result = kube.apply(child, likely_absent=new)
        if result == "foreign":
            applied.foreign.append(key)
    names, namespace, uid = _identity(job)
    rendered = {(c["apiVersion"], c["kind"]) for c in children}
    for (api_version, kind), name_of in kinds.OPTIONAL.items():
        if (api_version, kind) in rendered:
            continue
        name = name_of(names)
        if kube.delete_owned(api_version, kind, namespace, name, uid) == "deleted":
            applied.results[f"{kind}/{name}"] = "deleted"
    return applied


def drifted(job: DistBeliefJob, children: list[Manifest], seen: Mapping[str, Any], *, gone: bool) -> bool:
    """Whether the job's child a watch saw (seen; gone: it was deleted) no longer matches
    children, the job's rendered children: a child the job wants that is gone or differs,
    or an optional child the spec no longer asks for. Another's object never drifts."""
    if controller_uid(seen) != _identity(job)[2]:
        return False
    wanted = _wanted(children, seen)
    if wanted is None:
        return not gone and (seen.get("apiVersion"), seen.get("kind")) in kinds.OPTIONAL
    return gone or not contains(seen, mutable_part(wanted))


def put_back(kube: Kube, job: DistBeliefJob, children: list[Manifest], seen: Mapping[str, Any], *,
             gone: bool) -> str | None:
    """Make a drifted child match the job again: "created", "patched", "deleted" (an optional
    child the spec no longer asks for), or None when there was nothing to do."""
    if not drifted(job, children, seen, gone=gone):
        return None
    wanted = _wanted(children, seen)
    if wanted is None:
        found = kube.delete_owned(seen["apiVersion"], seen["kind"], seen["metadata"]["namespace"],
                                  seen["metadata"]["name"], _identity(job)[2])
        return "deleted" if found == "deleted" else None
    result = kube.apply(wanted, likely_absent=True) if gone else kube.apply(wanted, live=dict(seen))
    return result if result in ("created", "patched") else None


def _wanted(children: list[Manifest], seen: Mapping[str, Any]) -> Manifest | None:
    return next((c for c in children if c["kind"] == seen.get("kind")
                 and c["metadata"]["name"] == seen["metadata"]["name"]), None)


def stale_claims(kube: Kube, job: DistBeliefJob) -> list[str]:
    """The checkpoint claims the job's shards would mount that another job made: a job of the
    same name, deleted with its claims kept (retention Retain). Their names, sorted.

    Only the claims labelled with the job's name are listed: every claim a job's
    StatefulSet makes carries its template's labels, the job's name among them (since the
    first version). Listing every claim of the namespace instead made each new job's first
    reconcile read all its neighbours' claims, quadratic in the jobs of a namespace (at
    1,000 jobs, 2,000 claims read per new job: docs/scale.md)."""
    names, namespace, uid = _identity(job)
    pattern = re.compile(rf"{re.escape(contract.CHECKPOINT_VOLUME)}-{re.escape(names.ps)}-[0-9]+\Z")
    claims = kube.list("v1", "PersistentVolumeClaim", namespace, {contract.LABEL_JOB: names.job})
    return sorted(claim["metadata"]["name"] for claim in claims if pattern.match(claim["metadata"]["name"])
                  and (claim["metadata"].get("labels") or {}).get(JOB_UID_LABEL) != uid)


def _identity(job: DistBeliefJob) -> tuple[contract.JobNames, str, str]:
    return job.config.names, job.config.namespace, job.config.uid or ""


def stop_workloads(kube: Kube, job: DistBeliefJob) -> None:
    """Scale the job's own StatefulSet and Deployments to 0 without rendering them (for a
    job whose spec cannot be rendered any more)."""
    names, namespace, uid = _identity(job)
    for kind in ("StatefulSet", "Deployment"):
        for workload in kube.list("apps/v1", kind, namespace, {contract.LABEL_JOB: names.job}):
            if controller_uid(workload) == uid and workload["spec"].get("replicas"):
                kube.patch("apps/v1", kind, namespace, workload["metadata"]["name"],
                           {"metadata": {"uid": workload["metadata"]["uid"]}, "spec": {"replicas": 0}})
