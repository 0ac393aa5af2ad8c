"""Kueue's contract for a job labelled kueue.x-k8s.io/queue-name, on the job's own Workload.

    not admitted                ->  the job is suspended (spec.runPolicy.suspend: true), also
                                    when created, and again if someone unsuspends it
    admitted (status.admission  ->  the admission's node labels and tolerations (its
      and Admitted True)            ResourceFlavors', and its admission checks' podSetUpdates)
                                    go into the job's admission annotation,
                                    and the job is unsuspended: its pods start there
    evicted (Evicted True)      ->  the job is suspended (its checkpoints stay) and the
                                    annotation removed; then the Workload's admission is
                                    cleared (QuotaReserved False), as Kueue's own job
                                    integrations do, so that Kueue queues it again
    finished                    ->  the Workload gets Finished True: Kueue releases the quota

    scaled, or resharded        ->  the Workload is made anew with the new pod counts (a
                                    reshard's as it starts: cluster/resharding.as_queued); a
                                    job that was running is suspended and waits to be
                                    admitted again (its checkpoints kept)

The Workload is owned by the job (render.render_workload). `sync` runs at every
reconcile and status pass; each call makes at most one transition.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Mapping
from typing import Any

from distbelief.operator.cluster.kube import Kube
from distbelief.operator.render import queue, render
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract

log = logging.getLogger(__name__)

WORKLOAD = (queue.WORKLOAD_API_VERSION, "Workload")
FLAVOR = (queue.WORKLOAD_API_VERSION, "ResourceFlavor")
ADMITTED, EVICTED, FINISHED, QUOTA_RESERVED = "Admitted", "Evicted", "Finished", "QuotaReserved"


def _condition(workload: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    found = [c for c in (workload.get("status") or {}).get("conditions") or [] if c.get("type") == kind]
    return found[0] if found and found[0].get("status") == "True" else None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _with_conditions(workload: Mapping[str, Any], *changes: tuple[str, str, str, str]) -> list[dict[str, Any]]:
    """The Workload's conditions with each (type, status, reason, message) set."""
    conditions = {c["type"]: dict(c) for c in (workload.get("status") or {}).get("conditions") or []}
    for kind, status, reason, message in changes:
        if (conditions.get(kind) or {}).get("status") != status:
            conditions[kind] = {"type": kind, "status": status, "reason": reason, "message": message,
                                "lastTransitionTime": _now(),
                                "observedGeneration": workload["metadata"].get("generation", 0)}
    return list(conditions.values())


class QueuedJob:
    """One queue-labelled job (validated, as stored) and its Workload."""

    def __init__(self, kube: Kube, job: DistBeliefJob, image: str) -> None:
        self.kube, self.job, self.image = kube, job, image
        self.namespace, self.name = job.config.namespace, job.config.name
        self.workload_name = queue.workload_name(self.name)
        self.started = queue.ADMISSION_ANNOTATION in job.annotations
        self.suspended = job.config.spec.run_policy.suspend

    def sync(self, *, finished: bool) -> tuple[str, str] | None:
        """One step toward what the Workload says; returns (reason, message) while the job
        is held suspended by its queue, and the Event to post as ("event:<reason>", message)."""
        workload = self.kube.get(*WORKLOAD, self.namespace, self.workload_name)
        if workload is not None and not finished and self._outdated(workload):
            return self._requeue(workload)
        if workload is None:
            if finished:
                return None
            workload = self.kube.create(render.render_workload(self.job, image=self.image)) or {}
        if finished:
            if not _condition(workload, FINISHED):
                self._set_status(workload, None, (FINISHED, "True", "JobFinished", "the DistBeliefJob finished"))
            return None
        evicted = _condition(workload, EVICTED)
        admission = (workload.get("status") or {}).get("admission")
        if evicted:
            return self._evict(workload, evicted, admission)
        if admission and _condition(workload, ADMITTED):
            if not self.started:
                self._start(admission, (workload.get("status") or {}).get("admissionChecks") or [])
                return ("event:Admitted", f"admitted by ClusterQueue {admission.get('clusterQueue', '')}")
            return None
        if not self.suspended:
            self._patch_job(suspend=True, placement=None)
        return ("Queued", f"waiting for Kueue to admit Workload {self.workload_name} "
                          f"from queue {queue.queue_name(self.job)}")

    def _outdated(self, workload: Mapping[str, Any]) -> bool:
        """Whether the Workload's pod counts are not the job's (the job was scaled)."""
        wanted = render.render_workload(self.job, image=self.image)["spec"]["podSets"]
        return [(s["name"], s["count"]) for s in workload["spec"]["podSets"]] != \
            [(s["name"], s["count"]) for s in wanted]

    def _requeue(self, workload: Mapping[str, Any]) -> tuple[str, str]:
        """The job was scaled: as Kueue's own integrations do, its Workload is made anew with
        the new counts, so that the queue counts what will run; a job that ran under the old
        admission is suspended first (its checkpoints kept) and waits for the new one."""
        message = f"the job's pod counts changed: Workload {self.workload_name} made anew"
        if self.started or not self.suspended:
            self._patch_job(suspend=True, placement=None)
            message += ", the job suspended until it is admitted again"
        self.kube.delete(*WORKLOAD, self.namespace, self.workload_name, uid=workload["metadata"]["uid"])
        self.kube.create(render.render_workload(self.job, image=self.image))  # None (409) while the old one goes
        return ("event:Requeued", message)

    def _evict(self, workload: Mapping[str, Any], evicted: Mapping[str, Any],
               admission: Any) -> tuple[str, str]:
        message = f"evicted by Kueue ({evicted.get('reason', '')}: {evicted.get('message', '')}); " \
                  "the checkpoints are kept and the job resumes from them when admitted again"
        if self.started or not self.suspended:
            self._patch_job(suspend=True, placement=None)
            return ("event:Evicted", message)
        if admission is not None:  # the job has stopped: give the quota back, Kueue queues it again
            self._set_status(workload, None, (QUOTA_RESERVED, "False", "Pending", "the job was evicted"),
                             (ADMITTED, "False", "NoReservation", "the job was evicted"))
        return ("Evicted", message)

    def _start(self, admission: Mapping[str, Any], checks: list[Mapping[str, Any]]) -> None:
        names = {n for a in admission.get("podSetAssignments") or [] for n in (a.get("flavors") or {}).values()}
        flavors = {n: self.kube.get(*FLAVOR, None, n) or {} for n in sorted(names)}  # type: ignore[arg-type]
        self._patch_job(suspend=False, placement=queue.placement_of(admission, flavors, checks))

    def _patch_job(self, *, suspend: bool, placement: Mapping[str, Any] | None) -> None:
        annotation = json.dumps(placement, sort_keys=True) if placement is not None else None
        self.kube.patch(contract.JOB_API_VERSION, contract.KIND, self.namespace, self.name,
                        {"metadata": {"annotations": {queue.ADMISSION_ANNOTATION: annotation}},
                         "spec": {"runPolicy": {"suspend": suspend}}})
        log.info("event=queue_%s job=%s namespace=%s", "suspend" if suspend else "start", self.name, self.namespace)

    def _set_status(self, workload: Mapping[str, Any], admission: Any, *changes: tuple[str, str, str, str]) -> None:
        status: dict[str, Any] = {"conditions": _with_conditions(workload, *changes)}
        if any(kind == QUOTA_RESERVED for kind, *_ in changes):
            status["admission"] = admission
        self.kube.patch(*WORKLOAD, self.namespace, self.workload_name, {"status": status}, subresource="status")
