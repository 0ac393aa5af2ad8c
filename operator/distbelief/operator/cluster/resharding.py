"""A changed spec.parameterServers.shards, followed on a running or suspended job, one step
per status pass:

    held        locks.locked_job: the job renders with its recorded count, held: its
                replicas and shards scale to 0, each shard writing a checkpoint as it stops
    re-laid     once no shard pod is left: the claims of the new shard pods, the count
                it goes to recorded (locks.RESHARDING_ANNOTATION), and the Job
                <job>-reshard (render/reshardjob.py), which re-lays the claims
    resumed     the Job succeeded: the new count recorded as the job's, the Job deleted,
                and the children applied for it (handlers.py): the shards restore the
                re-laid checkpoints at the step they stopped at
    failed      the Job failed: the job stays held at its recorded count, the Resharding
                condition False with the pod's error; another count starts another Job

The Job's labels hold both counts, and the job's count changes only once the claims hold
the new layout: a restarted operator picks up where the last one was (a Job that ran again
over claims already laid for its count changes nothing).
Setting the count back during a reshard runs a reshard to it, which finishes or undoes the
one under way (the Job's folder protocol), so the claims always end in one layout.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import time
from typing import Any, Mapping, Sequence

import kopf

from distbelief.operator.cluster.kube import Kube, controller_uid
from distbelief.operator.cluster.locks import (RESHARDED_ANNOTATION, RESHARDING_ANNOTATION, SHARDS_ANNOTATION, Locked,
                                              locked_job)
from distbelief.operator.render import reshardjob
from distbelief.operator.render.context import RenderContext
from distbelief.operator.status.status import RESHARDED, RESHARDING, how_it_ended
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract

log = logging.getLogger(__name__)

JOBS = ("batch/v1", "Job")
# Testing only: SIGKILL the operator once a reshard reaches this step (one of STEPS), just
# after its change to the cluster (tests/cluster/test_cluster_operator.py).
KILL_AT_ENV = "DISTBELIEF_RESHARD_KILL_AT"
# How long a completed Job waits for its pod's outcome (the step it resharded at) to be seen.
SAID_WAIT_SECONDS = 30
STEPS = ("claims-made", "target-recorded", "job-created", "outcome-recorded", "job-deleted", "count-recorded")
FAILED = "ReshardFailed"


@dataclasses.dataclass(frozen=True)
class Progress:
    """The Resharding condition a pass leaves, and the count the job now has once a reshard ended."""

    status: str
    reason: str
    message: str
    resharded: int | None = None

    def condition(self) -> tuple[str, str, str]:
        return self.status, self.reason, self.message


def follow(kube: Kube, locked: Locked, pods: Sequence[Mapping[str, Any]], image: str) -> Progress | None:
    """One step of the reshard locked.reshard asks for (pods: the job's pods, as seen); None
    when the job as stored has moved past locked's view of it (see _stale)."""
    assert locked.reshard is not None
    job, target = locked.job, locked.reshard.target
    names, namespace = job.config.names, job.config.namespace
    if _stale(kube, locked):
        return None
    name = reshardjob.job_name(names)
    live = kube.get(*JOBS, namespace, name)
    if live is not None and controller_uid(live) != job.config.uid:
        return Progress("True", "ReshardJobForeign", f"Job {name} exists but is not this job's (no controller "
                                                     "reference to it): delete it, and the reshard goes on")
    if live is not None:
        return _followed(kube, locked, live, _ended(live), pods)
    stopping = [pod for pod in pods if _role(pod) == contract.ROLE_PS]
    recorded = locked.reshard.recorded
    if stopping:
        return Progress("True", RESHARDING, f"resharding from {recorded} to {target} shards: {len(stopping)} shard "
                                            "pods stopping (each writes a checkpoint as it stops)")
    ctx = RenderContext.of(job, image=image)
    copies = job.config.spec.parameter_servers.copies
    for pod in range(recorded * copies, target * copies):
        kube.create(reshardjob.render_claim(ctx, pod))
    _reached("claims-made")
    kube.patch(contract.JOB_API_VERSION, contract.KIND, namespace, job.config.name,
               {"metadata": {"annotations": {RESHARDING_ANNOTATION: str(target)}}})
    _reached("target-recorded")
    kube.create(reshardjob.render_reshard_job(ctx, recorded, target))
    _reached("job-created")
    log.info("event=reshard_started job=%s namespace=%s before=%d after=%d", names.job, namespace, recorded, target)
    return Progress("True", RESHARDING, f"resharding from {recorded} to {target} shards: Job {name} started")


def _followed(kube: Kube, locked: Locked, live: Mapping[str, Any], ended: str | None,
              pods: Sequence[Mapping[str, Any]]) -> Progress:
    """The step for a reshard Job that exists."""
    assert locked.reshard is not None
    job, target = locked.job, locked.reshard.target
    labels = live["metadata"].get("labels") or {}
    before, after = int(labels[reshardjob.FROM_LABEL]), int(labels[reshardjob.TO_LABEL])
    name, said = live["metadata"]["name"], _said(pods)
    if ended is None:
        return Progress("True", RESHARDING, f"resharding from {before} to {after} shards: Job {name} runs"
                                            + _unschedulable(pods))
    if ended == "Failed" and after == target:
        return Progress("False", FAILED, f"the reshard from {before} to {after} shards failed ({said or f'Job {name}'}); "
                                         f"the job keeps {before} shards, stopped: set spec.parameterServers.shards "
                                         f"to {before} to resume it, or to another count to reshard again")
    if ended == "Complete" and after == target and not said and _ended_within(live, SAID_WAIT_SECONDS):
        return Progress("True", RESHARDING, f"resharding from {before} to {after} shards: Job {name} completed")
    if ended == "Complete" and after == target:
        # The outcome, then the Job, then the count: killed in between, the next pass runs
        # another Job, which finds the claims laid for `after` already and changes nothing;
        # the outcome recorded first keeps the step this one re-laid them at.
        outcome = _outcome(job, said, before, after)
        _record(kube, job, before, resharding_to=target, outcome=outcome)
        _reached("outcome-recorded")
        kube.delete(*JOBS, job.config.namespace, name, uid=live["metadata"]["uid"])
        _reached("job-deleted")
        _record(kube, job, after, resharding_to=None)
        _reached("count-recorded")
        log.info("event=reshard_ended job=%s before=%d after=%d", job.config.name, before, after)
        return Progress("False", RESHARDED, outcome, resharded=after)
    if ended == "Complete":   # the spec moved on meanwhile: what the claims hold first, then another Job
        # With its outcome: set back to `after` before the next pass, the spec needs no other Job.
        _record(kube, job, after, resharding_to=target, outcome=said or f"resharded from {before} to {after} shards")
    kube.delete(*JOBS, job.config.namespace, name, uid=live["metadata"]["uid"])
    log.info("event=reshard_ended job=%s outcome=%s before=%d after=%d target=%d", job.config.name, ended, before,
             after, target)
    return Progress("True", RESHARDING, f"resharding to {target} shards (the Job to {after} ended: {ended})")


def _outcome(job: DistBeliefJob, said: str, before: int, after: int) -> str:
    """How the reshard from `before` to `after` ended: what its pod said, unless that pod only
    found the claims laid already (a Job run again after a kill) and an earlier pass recorded
    what the Job that laid them said."""
    done = f"resharded from {before} to {after} shards"
    recorded = job.annotations.get(RESHARDED_ANNOTATION, "")
    if not said.startswith(done) and recorded.startswith(done):
        return recorded
    return said or done


def post_event(body: kopf.Body, progress: Progress) -> None:
    """An Event for each new state of the job's Resharding condition."""
    conditions: list[Mapping[str, Any]] = list(dict(body.status or {}).get("conditions") or [])
    before: Mapping[str, Any] = next((c for c in conditions if c.get("type") == RESHARDING), {})
    if (before.get("status"), before.get("reason")) != (progress.status, progress.reason):
        post = kopf.info if progress.reason in (RESHARDING, RESHARDED) else kopf.warn
        post(body, reason=progress.reason, message=progress.message)


def _stale(kube: Kube, locked: Locked) -> bool:
    """Whether the job as stored records another count than locked's view of it. A pass
    reads the job as the operator's watch last delivered it, which can predate the count
    the last pass recorded: acting on it would run the ended reshard again."""
    assert locked.reshard is not None
    config = locked.job.config
    stored = kube.get(contract.JOB_API_VERSION, contract.KIND, config.namespace, config.name)
    annotations: Mapping[str, str] = (stored["metadata"].get("annotations") or {}) if stored else {}
    return annotations.get(SHARDS_ANNOTATION) != str(locked.reshard.recorded)


def _record(kube: Kube, job: DistBeliefJob, shards: int, *, resharding_to: int | None,
            outcome: str | None = None) -> None:
    """The count the claims are laid for, as the job's, the count a reshard goes to, and with
    outcome, how the reshard to `shards` ended: in one write."""
    annotations = {SHARDS_ANNOTATION: str(shards),
                   RESHARDING_ANNOTATION: None if resharding_to is None else str(resharding_to)}
    if outcome is not None:
        annotations[RESHARDED_ANNOTATION] = outcome
    kube.patch(contract.JOB_API_VERSION, contract.KIND, job.config.namespace, job.config.name,
               {"metadata": {"annotations": annotations}})


def ended(job: DistBeliefJob) -> Progress | None:
    """How the job's last reshard ended, as recorded with its count (None: none ended)."""
    outcome = job.annotations.get(RESHARDED_ANNOTATION)
    return Progress("False", RESHARDED, outcome) if outcome else None


def after_reshard(validated: Mapping[str, Any], shards: int) -> dict[str, Any]:
    """The job's stored form once a reshard to `shards` is recorded."""
    annotations = {k: v for k, v in (validated["metadata"].get("annotations") or {}).items()
                   if k != RESHARDING_ANNOTATION}
    return {**validated, "metadata": {**validated["metadata"], "annotations": {**annotations,
                                                                              SHARDS_ANNOTATION: str(shards)}}}


def as_queued(job: DistBeliefJob, locked: Locked, stored_job: Mapping[str, Any]) -> DistBeliefJob:
    """The job as its Kueue Workload asks for it: while it is resharded, with the count it
    is resharded to, so that it waits suspended for an admission of what will run
    (cluster/queue.py makes the Workload anew when its counts change)."""
    if locked.reshard is None:
        return job
    return locked_job(after_reshard(stored_job, stored_job["spec"]["parameterServers"]["shards"])).job


def _reached(step: str) -> None:
    if os.environ.get(KILL_AT_ENV) == step:
        log.warning("event=killed_for_a_test step=%s", step)
        os.kill(os.getpid(), signal.SIGKILL)


def _ended_within(live: Mapping[str, Any], seconds: float) -> bool:
    """Whether the Job completed less than `seconds` ago (its pod's last status may not have
    reached the operator's watch yet)."""
    done = str((live.get("status") or {}).get("completionTime") or "")
    return bool(done) and time.time() - datetime.datetime.fromisoformat(done).timestamp() < seconds


def _ended(live: Mapping[str, Any]) -> str | None:
    """"Complete" or "Failed" once the Job says so."""
    for condition in (live.get("status") or {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return str(condition["type"])
    return None


def _said(pods: Sequence[Mapping[str, Any]]) -> str:
    """What the reshard pod that ended last said: its outcome, or how it failed."""
    ends = [(container.get("state") or {}).get("terminated") or {}
            for pod in pods if _role(pod) == reshardjob.ROLE
            for container in (pod.get("status") or {}).get("containerStatuses", [])]
    ends = sorted((end for end in ends if "exitCode" in end), key=lambda end: end.get("finishedAt") or "")
    if not ends:
        return ""
    last = ends[-1]
    return (last.get("message") or "").strip() if last["exitCode"] == 0 else how_it_ended("the reshard pod", last)


def _unschedulable(pods: Sequence[Mapping[str, Any]]) -> str:
    """Why the scheduler leaves a reshard pod Pending, if it does: its pod mounts every claim
    at once, which local volumes pinned to different nodes forbid."""
    for pod in pods:
        if _role(pod) == reshardjob.ROLE:
            for condition in (pod.get("status") or {}).get("conditions") or []:
                if (condition.get("type"), condition.get("status"), condition.get("reason")) == (
                        "PodScheduled", "False", "Unschedulable"):
                    return (f"; its pod cannot be scheduled ({condition.get('message') or 'no reason given'}): it "
                            "mounts every claim at once, so they must be reachable from one node")
    return ""


def _role(pod: Mapping[str, Any]) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(contract.LABEL_ROLE)
