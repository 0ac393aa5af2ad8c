"""The kopf handlers: reconcile a DistBeliefJob's children, and keep its status current.

    create / resume / spec update  ->  reconcile(): validate, check for another job's
                                                    checkpoints, create the key Secret once,
                                                    render, apply every child the job owns
    timer (every STATUS_INTERVAL)  ->  observe():   read children (observing.py: from the
                                                    operator's watches) and the chief's metrics,
                                                    compute the status, act on completion,
                                                    delete the job when its TTL has passed
    a child changed or deleted     ->  childwatch.put_back(): the child made to match its job again

reconcile() and observe() count their outcomes, errors and time in cluster/metrics.py.

A job labelled kueue.x-k8s.io/queue-name also follows its Kueue Workload at every
reconcile and status pass (cluster/queue.py): held suspended until admitted, placed where
the admission says, suspended again by an eviction.

Nothing is silent. A spec that the CRD let through but validate_job refuses fails the
job (phase Failed, reason InvalidSpec, a Warning Event). While the operator refuses to
create the children (another job's checkpoint claims, a foreign keys Secret, an object
of a child's name that the job does not own) the Created condition says why, a Warning
Event says it once, and reconcile() tries again every BLOCKED_RETRY_SECONDS. Every phase
change posts an Event.

The spec is the one source of truth: `kubectl scale` and the HPA both write
spec.workers.replicas through the scale subresource, and reconcile() follows, for every
partition's Deployment alike. The shard and partition counts are recorded at creation
(annotations distbelief.io/shards and distbelief.io/partitions, cluster/locks.py): a
changed shard count is followed by a reshard, one step per status pass
(cluster/resharding.py); a changed partition count is refused with a condition, because
the parameters' placement on the shards follows the partitions.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import os
import threading
from typing import Any, Literal, Mapping, NoReturn

import kopf

from distbelief.operator import errors
from distbelief.operator.cluster import children, locks, metrics, peering as peering_watch, resharding
from distbelief.operator.cluster.queue import QueuedJob
from distbelief.operator.cluster.kube import Kube, share_one_client
from distbelief.operator.cluster.observing import Seen, read_observed
from distbelief.operator.render import context, queue, render, secret, sizing
from distbelief.operator.validation import spec as job_spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import events
from distbelief.operator.status.progress import parse_timestamp
from distbelief.operator.status.status import FAILED, TERMINAL, UPDATES_LOST, WARNINGS, Observed, compute_status
from distbelief.runtime import contract, keys

log = logging.getLogger(__name__)

RESOURCE = (contract.API_GROUP, contract.API_VERSION, contract.PLURAL)
# The uid of the keys Secret this operator created for the job: the job's record that the
# Secret of that name is its own (the operator may create Secrets, never read them).
KEYS_ANNOTATION = f"{contract.API_GROUP}/keys-secret-uid"
# How often reconcile() looks again while it refuses to create a job's children.
BLOCKED_RETRY_SECONDS = float(os.environ.get("DISTBELIEF_BLOCKED_RETRY_SECONDS", "30"))
STATUS_INTERVAL = float(os.environ.get("DISTBELIEF_STATUS_INTERVAL", "5"))
# kopf's executor: a status pass holds a thread while it scrapes the chief's metrics and
# patches the status (what it reads of the children comes from the watches' indexes), so
# the CPUs + 4 of kopf's default leave passes queued behind each other from a few hundred
# jobs on (docs/benchmarks.md, the operator at 1,000 jobs).
HANDLER_THREADS = int(os.environ.get("DISTBELIEF_HANDLER_THREADS", "32"))
IMAGE = os.environ.get("DISTBELIEF_RUNTIME_IMAGE", context.DEFAULT_IMAGE)
# The operator's own namespace (the chart sets it from the downward API): the jobs'
# NetworkPolicies admit the operator's metrics scrapes from there.
OPERATOR_NAMESPACE = os.environ.get("DISTBELIEF_OPERATOR_NAMESPACE") or None


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Progress and diff-base live in annotations: a structural schema would prune them
    # from status (and we keep status for the user).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.distbelief.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kopf.distbelief.io", key="last-handled-configuration")
    settings.posting.level = logging.INFO
    settings.posting.loggers = False  # only the explicit transitions below become Events
    settings.watching.server_timeout = 120
    # A job deleted while its status timer runs: let kopf release its finalizer promptly
    # (the default polls the timer's cancellation for 60 s).
    settings.background.cancellation_polling = 1
    settings.execution.max_workers = HANDLER_THREADS
    _load_kube_config()
    # One client for every handler: kept-alive connections instead of a TLS handshake per
    # call, a pool as large as the threads that share it (and the watches beside them).
    share_one_client(connections=HANDLER_THREADS + 8)


@kopf.on.startup()
def watch_peering(memo: kopf.Memo, **_: Any) -> None:
    """Warn while kopf's peering object is missing (kopf itself pauses silently)."""
    if memo.get("peering"):
        memo["peering_stop"] = threading.Event()
        peering_watch.watch(memo["peering"], memo["namespaces"], memo["peering_stop"])


@kopf.on.cleanup()
def stop_peering_watch(memo: kopf.Memo, **_: Any) -> None:
    if memo.get("peering_stop"):
        memo["peering_stop"].set()


def _load_kube_config() -> None:
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def stored(body: Mapping[str, Any]) -> dict[str, Any]:
    return {k: copy.deepcopy(body[k]) for k in ("apiVersion", "kind", "metadata", "spec")}


def validated(body: Mapping[str, Any]) -> dict[str, Any]:
    """The job with the CRD's defaults; SpecError when the rules refuse it. A field this
    operator does not know came with a newer CRD (the API server prunes any other): it is
    ignored, and said once, rather than failing a stored job."""
    pruned: list[str] = []
    job = job_spec.validate_job(stored(body), pruned=pruned)
    if pruned and _PRUNED_SAID.get(body["metadata"].get("uid")) != pruned:
        if len(_PRUNED_SAID) >= 4096:
            _PRUNED_SAID.clear()
        _PRUNED_SAID[body["metadata"].get("uid")] = pruned
        log.warning("event=fields_unknown job=%s fields=%s note=a_newer_crd_than_this_operator",
                    body["metadata"].get("name"), ",".join(pruned))
    return job


# The unknown fields last logged per job uid (a CRD newer than the operator): said once.
_PRUNED_SAID: dict[str | None, list[str]] = {}


@kopf.on.create(*RESOURCE)
@kopf.on.resume(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
def reconcile(body: kopf.Body, patch: kopf.Patch, reason: str, memo: kopf.Memo, old: Any = None, new: Any = None,
              **_: Any) -> None:
    with metrics.OPERATOR.reconciling() as attempt:
        attempt.outcome = apply_job(body, patch, reason, memo)
    if attempt.outcome == metrics.APPLIED and reason == "update":
        _tell_scaled(body, old, new)


def _tell_scaled(body: kopf.Body, old: Any, new: Any) -> None:
    """An Event for a change of the model replicas (kubectl scale, the autoscaler): the job's
    history of its sizes."""
    before, after = ((spec or {}).get("workers", {}).get("replicas") for spec in (old, new))
    if before is not None and after is not None and before != after:
        kopf.info(body, reason="WorkersScaled", message=f"model replicas {before} -> {after}")


def apply_job(body: kopf.Body, patch: kopf.Patch, reason: str, memo: kopf.Memo) -> str:
    """Make the job's children what its spec asks for; the outcome (cluster/metrics.py)."""
    try:
        stored_job = validated(body)
        locked = locks.locked_job(stored_job)
    except errors.SpecError as exc:  # the CRD let it through (a server without its rules): observe() fails it
        log.warning("event=invalid_spec job=%s problems=%r", body.metadata.name, str(exc))
        return metrics.INVALID_SPEC
    job, refusals = locked.job, locked.refusals
    recorded = {}
    for lock in locks.LOCKS:
        if lock.condition in refusals:
            kopf.warn(body, reason=lock.condition, message=refusals[lock.condition])
        elif lock.annotation not in (body.metadata.annotations or {}):
            recorded[lock.annotation] = str(lock.wanted(job.config.spec))
    if locks.IMAGE_ANNOTATION not in (body.metadata.annotations or {}):
        recorded[locks.IMAGE_ANNOTATION] = IMAGE
    for line in sizing.warnings(job.config.spec):
        kopf.warn(body, reason="MemoryLimitLow", message=line)
    finished = (body.status or {}).get("phase") in TERMINAL
    kube = Kube()
    names, namespace = job.config.names, job.config.namespace
    if queue.queue_name(job) and sync_queue(kube, body, resharding.as_queued(job, locked, stored_job), finished=finished):
        # Held by its queue: rendered suspended even if its admission annotation says otherwise
        # (written by hand, or left from an admission Kueue has withdrawn).
        job = dataclasses.replace(job, annotations={k: v for k, v in job.annotations.items()
                                                    if k != queue.ADMISSION_ANNOTATION})
    if locks.SHARDS_ANNOTATION not in (body.metadata.annotations or {}):  # the job's first reconcile
        stale = children.stale_claims(kube, job)
        if stale:
            _block(body, memo, "CheckpointsOfAnotherJob", (
                f"PersistentVolumeClaims {', '.join(stale)} hold the checkpoints of an earlier job named "
                f"{names.job} (deleted with retention: Retain); a new job does not resume another job's training. "
                f"Delete them (kubectl -n {namespace} delete pvc {' '.join(stale)}) and this job starts afresh, "
                "or create it under another name"))
    ownership = ensure_keys_secret(kube, job)
    if ownership == "created":
        kopf.info(body, reason="KeysCreated", message=f"Secret {names.keys_secret} with the job's CurveZMQ keys")
    elif ownership == "foreign":
        _block(body, memo, "KeysSecretForeign", (
            f"Secret {names.keys_secret} exists but was not made for this job; the job will not use it "
            "(delete it, and the operator makes the job's own)"))
    applied = children.apply_all(kube, job, desired_children(job, finished=finished), new=reason == "create")
    if applied.foreign:
        _block(body, memo, "ForeignObject", (
            f"{', '.join(applied.foreign)} exist but are not this job's (no controller reference to it): the "
            "operator leaves them alone and creates nothing in their place; delete or rename them, or create "
            "the job under another name"))
    memo["blocked"] = memo["warned"] = None
    patch.metadata.annotations.update(recorded)  # only once the children are the job's
    if applied.changed:
        kopf.info(body, reason="ChildrenApplied" if reason != "update" else "SpecApplied",
                  message=", ".join(f"{name} {result}" for name, result in applied.changed.items()))
    return metrics.APPLIED


def sync_queue(kube: Kube, body: kopf.Body, job: DistBeliefJob, *, finished: bool) -> tuple[str, str] | None:
    """One step of Kueue's contract (cluster/queue.py); an Event for each transition."""
    try:
        hold = QueuedJob(kube, job, locks.runtime_image(job, IMAGE)).sync(finished=finished)
    except errors.KubeError as exc:  # Kueue's types absent, or a call refused: the job stays held
        log.warning("event=queue_failed job=%s error=%r", job.config.name, str(exc))
        return ("QueueUnavailable", f"cannot follow the job's Kueue Workload ({exc}); is Kueue installed?")
    if hold and hold[0].startswith("event:"):
        reason = hold[0].removeprefix("event:")
        (kopf.warn if reason == "Evicted" else kopf.info)(body, reason=reason, message=hold[1])
        return None if reason == "Admitted" else (reason, hold[1])
    return hold


def _block(body: kopf.Body, memo: kopf.Memo, reason: str, message: str) -> NoReturn:
    """Refuse to go on for now: the Created condition says why (observe() reads the memo), a
    Warning Event says so once, and kopf calls reconcile() again after a while."""
    memo["blocked"] = (reason, message)
    if memo.get("warned") != (reason, message):
        kopf.warn(body, reason=reason, message=message)
        memo["warned"] = (reason, message)
    raise kopf.TemporaryError(message, delay=BLOCKED_RETRY_SECONDS)


def desired_children(job: DistBeliefJob, *, finished: bool) -> list[dict[str, Any]]:
    return render.render_children(job, image=locks.runtime_image(job, IMAGE), finished=finished,
                                  held=queue.held(job) or locks.held_for_reshard(job),
                                  operator_namespace=OPERATOR_NAMESPACE)


def ensure_keys_secret(kube: Kube, job: DistBeliefJob) -> Literal["created", "own", "foreign"]:
    """Make sure the job's key Secret exists and is its own: "foreign" if one exists that is not.

    The operator only ever creates the Secret, and never reads one: the create answers
    409 when the name is taken, and the taken name is the job's own only if the job
    records (KEYS_ANNOTATION) that this operator created it. A Secret someone put there
    before the job, or before the operator's first reconcile, is refused rather than
    trusted, since whoever wrote it knows the keys. An existing own Secret is never
    changed: keys are not rotated behind the user's back.

    The body kopf hands over may be older than the job's record: kopf waits at most
    settings.persistence.consistency_timeout (5 s) for its own patch to come back in the
    watch, and under load runs the create handler again on the body it has, one from before
    the record. So a 409 for a body without the record reads the job as stored, which
    decides (issue 40: 562 of 1,000 healthy jobs were refused as foreign)."""
    names, namespace = job.config.names, job.config.namespace
    created = kube.create(secret.render_keys_secret(job, keys.JobKeys.generate().files()))
    if created is None:
        if KEYS_ANNOTATION in job.annotations:
            return "own"
        meta = (kube.get(*job_address(job)) or {}).get("metadata") or {}
        mine = meta.get("uid") == job.config.uid and KEYS_ANNOTATION in (meta.get("annotations") or {})
        return "own" if mine else "foreign"
    uid = (created.get("metadata") or {}).get("uid", "")
    # Recorded at once, not with the handler's patch: a crash in between would leave the
    # job's own Secret looking foreign.
    kube.patch(*job_address(job), {"metadata": {"annotations": {KEYS_ANNOTATION: uid}}})
    log.info("event=keys_created job=%s namespace=%s secret=%s uid=%s", names.job, namespace, names.keys_secret, uid)
    return "created"


@kopf.timer(*RESOURCE, interval=STATUS_INTERVAL, initial_delay=min(1.0, STATUS_INTERVAL))
def observe(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kwargs: Any) -> None:
    with metrics.OPERATOR.counting_errors("status"):
        update_status(body, patch, memo, Seen.of(kwargs))


def update_status(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, seen: Seen) -> None:
    """Read what the job's children (as the operator's watches saw them) and chief show, and
    write the job's status from it."""
    kube = Kube()
    finished = dict(body.status or {}).get("phase") in TERMINAL
    try:
        stored_job = validated(body)
        locked = locks.locked_job(stored_job)
        job, reshard = locked.job, resharding.ended(locked.job)
        if locked.reshard is not None and not finished:
            followed = _follow_reshard(kube, body, stored_job, locked, seen, memo)
            if followed is None:   # a view of the job older than the last pass's change
                return
            job, reshard = followed
        if memo.get("reshard_applying"):
            # Applied until it succeeds: once the new count is recorded, no other pass would.
            children.apply_all(kube, job, desired_children(job, finished=False))
            memo["reshard_applying"] = False
        observed = read_observed(seen, job, locked.refusals, blocked=memo.get("blocked"), resharding=reshard)
        if queue.queue_name(job):
            observed = dataclasses.replace(observed, queued=sync_queue(kube, body, resharding.as_queued(job, locked, stored_job),
                                                                       finished=finished))
    except errors.SpecError as exc:
        job, observed = DistBeliefJob.of(stored(body)), Observed(invalid_spec=f"the spec breaks the job's rules: {exc}")
    job = dataclasses.replace(job, status=copy.deepcopy(dict(body.status or {})))
    now = datetime.datetime.now(datetime.timezone.utc)
    status = compute_status(job, observed, now)
    metrics.OPERATOR.phases.set(body.metadata.namespace, body.metadata.name, status["phase"])
    before = job.status.get("phase")
    _warn_new_conditions(body, job.status.get("conditions", []), status["conditions"])
    if status["phase"] in TERMINAL and before not in TERMINAL:
        # The verdict is stored before the scale-down, so that the children's watch, reading
        # the job afresh, sees a finished job and does not put its replicas back.
        kube.patch(*job_address(job), {"status": status}, subresource="status")
        _finish(kube, body, job, status, stop_only=observed.invalid_spec is not None)
    elif status["phase"] != before:
        condition: dict[str, Any] = next((c for c in status["conditions"] if c["type"] == status["phase"]), {})
        kopf.info(body, reason=status["phase"], message=condition.get("message") or status["phase"])
    _post_shard_events(body, memo, observed, job.status.get("shards"), status.get("shards"))
    if _ttl_expired(job, status, now):
        kopf.info(body, reason="Deleted", message="ttlSecondsAfterFinished has passed since completion")
        kube.delete(*job_address(job))
        return
    current = {k: v for k, v in job.status.items() if k != "kopf"}
    if status != current:
        patch.status.update(status)


def _follow_reshard(kube: Kube, body: kopf.Body, stored_job: dict[str, Any], locked: locks.Locked,
                    seen: Seen, memo: kopf.Memo) -> tuple[DistBeliefJob, resharding.Progress] | None:
    """One step of the job's reshard (None for a stale view of the job: resharding.follow);
    once it ended, the job with its new count, its children to apply."""
    config = locked.job.config
    try:
        progress = resharding.follow(kube, locked, list(seen.pods.get((config.namespace, config.name), [])),
                                     locks.runtime_image(locked.job, IMAGE))
    except errors.KubeError as exc:
        raise kopf.TemporaryError(f"cannot follow the reshard: {exc}", delay=5) from exc
    if progress is None:
        return None
    resharding.post_event(body, progress)
    if progress.resharded is None:
        return locked.job, progress
    memo["reshard_applying"] = True
    return locks.locked_job(resharding.after_reshard(stored_job, progress.resharded)).job, progress


def _post_shard_events(body: kopf.Body, memo: kopf.Memo, observed: Observed, shards_before: Any,
                       shards_now: Any) -> None:
    """A Warning on every shard restart and failover since the last pass (status/events.py)."""
    for reason, message in [*events.restart_events(memo.get("shard_restarts"), observed.shard_pods or {}),
                            *events.failover_events(shards_before, shards_now)]:
        kopf.warn(body, reason=reason, message=message)
    if observed.shard_pods is not None:
        memo["shard_restarts"] = {pod: count for pod, (count, _) in observed.shard_pods.items()}


def _warn_new_conditions(body: kopf.Body, before: list[Mapping[str, Any]], after: list[Mapping[str, Any]]) -> None:
    """A Warning Event for each warning condition (ModelDegraded, RowBudgetReached, UpdatesLost)
    that just turned True, and again for UpdatesLost each time its count grows."""
    was = {c.get("type"): c.get("message") for c in before if c.get("status") == "True"}
    for condition in after:
        kind, message = condition.get("type"), condition.get("message", condition.get("type"))
        if kind in WARNINGS and condition.get("status") == "True" and (
                kind not in was or (kind == UPDATES_LOST and message != was[kind])):
            kopf.warn(body, reason=kind, message=message)


def _finish(kube: Kube, body: kopf.Body, job: DistBeliefJob, status: Mapping[str, Any], *,
            stop_only: bool = False) -> None:
    """Scale the finished job down (its objects and checkpoints stay) and say why. stop_only:
    the spec cannot be rendered (InvalidSpec), so only the job's workloads are scaled to 0."""
    condition = next(c for c in status["conditions"] if c["type"] == status["phase"])
    try:
        if stop_only:
            children.stop_workloads(kube, job)
        else:
            children.apply_all(kube, job, desired_children(job, finished=True))
    except errors.KubeError as exc:
        raise kopf.TemporaryError(f"cannot scale the finished job down: {exc}", delay=5) from exc
    post = kopf.info if status["phase"] != FAILED else kopf.warn
    post(body, reason=condition.get("reason", status["phase"]),
         message=f"{status['phase']}: {condition.get('message', '')}; replicas scaled to 0")


def _ttl_expired(job: DistBeliefJob, status: Mapping[str, Any], now: datetime.datetime) -> bool:
    ttl = job.config.spec.run_policy.ttl_seconds_after_finished
    done = status.get("completionTime")
    return ttl is not None and done is not None and (now - parse_timestamp(done)).total_seconds() >= ttl


def job_address(job: DistBeliefJob) -> tuple[str, str, str, str]:
    return contract.JOB_API_VERSION, contract.KIND, job.config.namespace, job.config.name
