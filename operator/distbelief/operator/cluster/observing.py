"""What a job's status pass reads, from the operator's own watches: no request to the API
server per pass.

    statefulsets_seen, deployments_seen   each workload the operator rendered, by
                                          (namespace, name): its owner and its status
    pods_seen                             each pod of a job, by (namespace, job): its name,
                                          labels, owner and container statuses

kopf keeps these indexes current from watches, fed by events, and fills them before any
handler runs. The index functions are coroutines: kopf runs them in its event loop, where
they only copy a few fields, so the pods' many events at a job's start do not queue for
the handler threads that reconcile() and the status passes need.

Read by GET and LIST, a pass cost the API server three requests per job every
statusInterval (600 a second at 1,000 jobs). Only the chief's figures are still fetched per
pass (a scrape of shard 0's metrics). Each index keeps a few fields of its objects, not
the objects (a pod's spec is most of it). docs/benchmarks.md has what this changed at 300
jobs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import kopf

from distbelief.operator.cluster.kube import controller_uid
from distbelief.operator.render import deployment, podparts, reshardjob
from distbelief.operator.status import events, scrape
from distbelief.operator.status.status import Observed, pod_failures
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract

# Where the chief (shard 0) serves its metrics; {job} {namespace} {pod} {service} {port}.
METRICS_URL = os.environ.get("DISTBELIEF_METRICS_URL", "http://{pod}.{service}.{namespace}.svc:{port}/metrics")
# (group/version, plural) of what the indexes watch, for the server-side label selector.
WATCHED = (("apps/v1", "statefulsets"), ("apps/v1", "deployments"), ("v1", "pods"))


def _kept(body: kopf.Body) -> dict[str, Any]:
    """What a status pass reads of an object (of a pod's conditions, only the scheduler's
    refusal: cluster/resharding.py says it)."""
    meta, status = body.metadata, dict(body.status)
    kept = {key: value for key, value in status.items() if key in ("readyReplicas", "replicas", "containerStatuses")}
    unscheduled = [c for c in status.get("conditions") or [] if (c.get("type"), c.get("status")) == ("PodScheduled", "False")]
    if unscheduled:
        kept["conditions"] = unscheduled
    return {"metadata": {"name": meta.name, "uid": meta.uid, "labels": dict(meta.labels),
                         "ownerReferences": [dict(ref) for ref in meta.get("ownerReferences", [])]},
            "status": kept}


@kopf.index("apps", "v1", "statefulsets", labels=podparts.MANAGED)
async def statefulsets_seen(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    return {(str(namespace), name): _kept(body)}


@kopf.index("apps", "v1", "deployments", labels=podparts.MANAGED)
async def deployments_seen(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    return {(str(namespace), name): _kept(body)}


@kopf.index("v1", "pods", labels={**podparts.MANAGED, contract.LABEL_JOB: kopf.PRESENT})
async def pods_seen(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    return {(str(namespace), labels[contract.LABEL_JOB]): _kept(body)}


@dataclasses.dataclass(frozen=True)
class Seen:
    """The three indexes, as kopf hands them to a handler (among its keyword arguments)."""

    statefulsets: kopf.Index[tuple[str, str], Any]
    deployments: kopf.Index[tuple[str, str], Any]
    pods: kopf.Index[tuple[str, str], Any]

    @classmethod
    def of(cls, handler_kwargs: Mapping[str, Any]) -> "Seen":
        return cls(handler_kwargs["statefulsets_seen"], handler_kwargs["deployments_seen"], handler_kwargs["pods_seen"])

    def workload(self, index: kopf.Index[tuple[str, str], Any], namespace: str, name: str,
                 uid: str | None) -> dict[str, Any]:
        """The workload of that name if the job controls it, else an empty object."""
        return next((found for found in index.get((namespace, name), []) if controller_uid(found) == uid), {})


def read_observed(seen: Seen, job: DistBeliefJob, refusals: Mapping[str, str],
                  blocked: tuple[str, str] | None = None, resharding: Any = None) -> Observed:
    """What the job's own children and pods show (objects of their names that the job does
    not own count as absent; a reshard's pod is not one of the job's roles), and the
    chief's figures. resharding: the reshard's progress (cluster/resharding.py)."""
    names, namespace, uid = job.config.names, job.config.namespace, job.config.uid
    sts = seen.workload(seen.statefulsets, namespace, names.ps, uid)
    deployments = [seen.workload(seen.deployments, namespace, name, uid).get("status") or {}
                   for name in deployment.worker_deployment_names(job.config)]
    pods = [pod for pod in seen.pods.get((namespace, names.job), [])
            if _role(pod) not in (contract.ROLE_PS, reshardjob.ROLE)
            or (_role(pod) == contract.ROLE_PS and controller_uid(pod) == (sts.get("metadata") or {}).get("uid"))]
    url = METRICS_URL.format(job=names.job, namespace=namespace, pod=names.shard_pod(0), service=names.ps,
                             port=contract.METRICS_PORT)
    return Observed(
        shards_ready=int((sts.get("status") or {}).get("readyReplicas", 0)),
        # A replica is one pod of each partition: count the partition with the fewest.
        workers=min(int(d.get("replicas", 0)) for d in deployments),
        workers_ready=min(int(d.get("readyReplicas", 0)) for d in deployments),
        figures=scrape.read(url) if sts else scrape.Figures(),
        **pod_failures(pods),
        shard_pods=events.shard_restarts(pods),
        children_created=bool(sts),
        shard_lock_message=refusals.get("ShardCountLocked"),
        partition_lock_message=refusals.get("PartitionCountLocked"),
        blocked=blocked,
        resharding=resharding.condition() if resharding else None,
    )


def _role(pod: Mapping[str, Any]) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(contract.LABEL_ROLE)
