"""The job's status as one pure function of what the operator observed.

`compute_status(job, observed, now)` takes the DistBeliefJob as stored, what the
children and the chief's metrics show, and the time; it returns the whole new status.
The operator writes it only when it differs from the stored one.

Conditions have the shape of metav1.Condition: type, status, reason, message,
lastTransitionTime and observedGeneration, every one of them set. Every condition type
is listed in every status (Pending has none of its own); one that does not hold names
the phase the job is in as its reason.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Mapping, Sequence

from distbelief.operator.status.progress import parse_timestamp, progress_fields, timestamp
from distbelief.operator.status.scrape import Figures
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract, jobspec

PENDING, RUNNING, SUSPENDED = "Pending", "Running", "Suspended"
SUCCEEDED, FAILED = contract.SUCCEEDED, contract.FAILED
TERMINAL = (SUCCEEDED, FAILED)
CONDITION_TYPES = ("Created", RUNNING, SUSPENDED, SUCCEEDED, FAILED)
# Conditions that warn of something the job's phase does not say; once True they stay
# (the pods that told may be gone), and the operator posts each as a Warning Event.
MODEL_DEGRADED, ROW_BUDGET_REACHED, UPDATES_LOST = contract.MODEL_DEGRADED, "RowBudgetReached", contract.UPDATES_LOST
WARNINGS = (MODEL_DEGRADED, ROW_BUDGET_REACHED, UPDATES_LOST)
# Grace beyond maxDuration before the operator itself fails a job whose chief is silent.
DEADLINE_GRACE_SECONDS = 60
CHIEF_ENDED = "the chief ended the job"
# The condition of a changed shard count (cluster/resharding.py), and its reason once done.
RESHARDING, RESHARDED = "Resharding", "Resharded"


@dataclasses.dataclass(frozen=True)
class Observed:
    """What the operator read from the cluster for one job."""

    shards_ready: int = 0
    workers: int = 0
    workers_ready: int = 0
    shard_restarts: int = 0        # the most restarts of any one shard container
    figures: Figures = Figures()
    children_created: bool = False
    shard_lock_message: str | None = None  # set when a shard-count change was refused
    partition_lock_message: str | None = None  # set when a partition-count change was refused
    invalid_spec: str | None = None        # the rules the spec breaks, when it passed the CRD but not validate_job
    blocked: tuple[str, str] | None = None  # (reason, message) while the operator refuses to create the children
    invalid_config: str | None = None      # "<pod>: <its last error>" of a pod that exited with a config error
    shard_failure: str | None = None       # how the most restarted shard last ended, for the message
    non_finite_loss: str | None = None     # which replica keeps computing a non-finite loss, and when
    restarts: int | None = None            # container restarts over the job's pods; None: no pods seen
    queued: tuple[str, str] | None = None  # (reason, message) while a Kueue queue holds the job suspended
    shard_pods: Mapping[str, tuple[int, str]] | None = None  # shard pod -> (restarts, how it last ended)
    resharding: tuple[str, str, str] | None = None  # the Resharding condition while a reshard goes on, or as it ended


def pod_failures(pods: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The fields of Observed that a job's pods show: the most restarts of one shard
    container whose last run failed (a shard that exits 0 has seen the job done), and how
    it ended; the first container that exited with a config error, and the first replica
    whose loss went non-finite (neither can a restart fix); and the restarts of all the
    job's containers (None without pods)."""
    invalid, diverged, restarts, failure = None, None, 0, None
    total = sum(c.get("restartCount", 0) for pod in pods for c in (pod.get("status") or {}).get("containerStatuses", []))
    for pod in pods:
        name, role = pod["metadata"]["name"], (pod["metadata"].get("labels") or {}).get(contract.LABEL_ROLE)
        for container in (pod.get("status") or {}).get("containerStatuses", []):
            ends = [(container.get(k) or {}).get("terminated") or {} for k in ("state", "lastState")]
            bad = next((end for end in ends if end.get("exitCode") == contract.EXIT_INVALID_CONFIG), None)
            if bad is not None and invalid is None:
                invalid = f"{name}: {_last_line(bad.get('message')) or 'exited with a config error'}"
            lost = next((end for end in ends if end.get("exitCode") == contract.EXIT_NON_FINITE_LOSS), None)
            if lost is not None and diverged is None:
                diverged = f"{name}: {_last_line(lost.get('message')) or 'its training loss went non-finite'}"
            if role == contract.ROLE_PS and container.get("restartCount", 0) >= max(restarts, 1) \
                    and ends[1].get("exitCode") != 0:  # a shard that ended cleanly (the job done) did not fail
                restarts, last = container["restartCount"], ends[1]
                failure = how_it_ended(name, last) if "exitCode" in last else None
    return {"invalid_config": invalid, "non_finite_loss": diverged, "shard_restarts": restarts,
            "shard_failure": failure, "restarts": total if pods else None}


def how_it_ended(pod: str, terminated: Mapping[str, Any]) -> str:
    """A container's last end as its status tells it: an OOMKilled one says so (its message is empty)."""
    killed = " (OOMKilled: over its memory limit)" if terminated.get("reason") == "OOMKilled" else ""
    last = _last_line(terminated.get("message"))
    return f"{pod} last exited with code {terminated['exitCode']}{killed}" + (f": {last}" if last else "")


def _last_line(text: str | None) -> str:
    """A role's one-line error ("error: ..."), else the last line of text."""
    lines = (text or "").strip().splitlines()
    return next((line for line in reversed(lines) if line.startswith("error: ")), lines[-1] if lines else "")


def compute_status(job: DistBeliefJob, observed: Observed, now: datetime.datetime) -> dict[str, Any]:
    """The new status, from job.status, the one before. job is validated, or with
    observed.invalid_spec as the API server stored it (its spec then holds the CRD's
    defaults, nothing more)."""
    spec, previous, generation = job.config.spec, job.status, job.generation
    phase, reason, message = _phase(spec, previous, observed, now)
    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": generation,
        "workers": {"replicas": observed.workers, "ready": observed.workers_ready},
        "parameterServers": {"shards": spec.parameter_servers.shards, "ready": observed.shards_ready},
        "selector": ",".join(f"{k}={v}" for k, v in
                             contract.selector_labels(job.config.name, contract.ROLE_WORKER).items()),
        "startTime": previous.get("startTime") or timestamp(now),
    }
    status.update(_training_figures(previous, observed.figures))
    status.update(progress_fields(spec.training, previous, status, running=phase == RUNNING,
                                  succeeded=phase == SUCCEEDED, now=now))
    shards = _shard_copies(job.config, observed.figures) or previous.get("shards")
    if shards:
        status["shards"] = shards
    restarts = observed.restarts if observed.restarts is not None else previous.get("restarts")
    if restarts is not None:  # the last count seen while the job had pods
        status["restarts"] = restarts
    if phase in TERMINAL:
        status["completionTime"] = previous.get("completionTime") or timestamp(now)
    status["conditions"] = _conditions(previous.get("conditions", []), (phase, reason, message), observed, now,
                                       generation)
    return status


def _phase(spec: jobspec.JobSpec, previous: Mapping[str, Any], observed: Observed,
           now: datetime.datetime) -> tuple[str, str, str]:
    """(phase, reason, message); a finished job stays finished."""
    if previous.get("phase") in TERMINAL:
        condition = _find(previous.get("conditions", []), previous["phase"]) or {}
        return previous["phase"], condition.get("reason", previous["phase"]), condition.get("message", "")
    if observed.invalid_spec:
        return FAILED, "InvalidSpec", observed.invalid_spec
    figures = observed.figures
    if figures.finished_outcome in TERMINAL:
        return figures.finished_outcome, figures.finished_reason or figures.finished_outcome, \
            f"{CHIEF_ENDED} at step {figures.global_step}"
    if observed.invalid_config:
        return FAILED, "InvalidConfig", observed.invalid_config
    if observed.non_finite_loss:
        return FAILED, "NonFiniteLoss", observed.non_finite_loss
    limit = spec.run_policy.backoff_limit
    if observed.shard_restarts > limit:
        detail = f"; {observed.shard_failure}" if observed.shard_failure else ""
        return FAILED, "BackoffLimitExceeded", \
            f"a parameter shard restarted {observed.shard_restarts} times (backoffLimit {limit}){detail}"
    deadline = _deadline_passed(spec, previous, now)
    if deadline:
        return FAILED, "DeadlineExceeded", deadline
    if spec.run_policy.suspend or observed.queued:
        return SUSPENDED, *(observed.queued or
                            ("Suspended", "runPolicy.suspend is true: no pods run, the checkpoints are kept"))
    if observed.resharding and observed.resharding[1] != RESHARDED:
        return PENDING, observed.resharding[1], observed.resharding[2]
    shards, replicas = spec.parameter_servers.shards, spec.workers.replicas
    if observed.shards_ready >= shards and observed.workers_ready >= min(1, replicas):
        return RUNNING, "Training", f"{shards} shards and {observed.workers_ready} replicas ready"
    return PENDING, "WaitingForPods", f"{observed.shards_ready}/{shards} shards and " \
        f"{observed.workers_ready}/{replicas} replicas ready"


def _deadline_passed(spec: jobspec.JobSpec, previous: Mapping[str, Any], now: datetime.datetime) -> str | None:
    limit, started = spec.training.max_duration_seconds, previous.get("startTime")
    if limit is None or not started or spec.run_policy.suspend:
        return None
    elapsed = (now - parse_timestamp(started)).total_seconds()
    if elapsed <= limit + DEADLINE_GRACE_SECONDS:
        return None
    return f"running for {elapsed:.0f} s, past maxDuration {spec.training.max_duration}, and the chief has not " \
        "ended the job"


def _training_figures(previous: Mapping[str, Any], figures: Figures) -> dict[str, Any]:
    """The chief's figures when it answered, else the last ones known."""
    keep = {k: previous[k] for k in ("globalStep", "loss", "accuracy", "auc", "examplesPerSecond", "objective",
                                     "epoch", "lastCheckpoint", "staleness") if k in previous}
    if not figures.reachable:
        return keep
    fresh: dict[str, Any] = {"globalStep": figures.global_step}
    for key, value in (("loss", figures.loss), ("accuracy", figures.accuracy), ("auc", figures.auc),
                       ("examplesPerSecond", figures.examples_per_second), ("objective", figures.objective),
                       ("epoch", figures.epoch)):
        if value is not None:
            fresh[key] = round(float(value), 6)
    if figures.checkpoint_step and figures.checkpoint_time:
        when = datetime.datetime.fromtimestamp(figures.checkpoint_time, tz=datetime.timezone.utc)
        fresh["lastCheckpoint"] = {"step": figures.checkpoint_step, "time": timestamp(when)}
    if figures.staleness_max is not None and figures.staleness_p50 is not None:
        fresh["staleness"] = {"max": figures.staleness_max, "p50": figures.staleness_p50}
    return {**keep, **fresh}


def _shard_copies(config: contract.JobConfig, figures: Figures) -> dict[str, Any] | None:
    """With backups: each shard's copies in sync, its primary's pod and its failovers."""
    if not figures.copies:
        return None
    shards, names = config.spec.parameter_servers.shards, config.names
    return {str(shard): {"copies": seen.get("copies", 0), "failovers": seen.get("failovers", 0),
                         "primary": names.shard_pod(seen.get("primary", 0) * shards + shard)}
            for shard, seen in sorted(figures.copies.items())}


def _conditions(previous: list[Mapping[str, Any]], verdict: tuple[str, str, str], observed: Observed,
                now: datetime.datetime, generation: int) -> list[dict[str, Any]]:
    phase, reason, message = verdict
    wanted = {kind: ("False", phase, f"the job is {phase}") for kind in CONDITION_TYPES}
    if phase in wanted:  # Pending has no condition of its own
        wanted[phase] = ("True", reason, message)
    if observed.blocked:
        wanted["Created"] = ("False", *observed.blocked)
    elif observed.children_created:
        wanted["Created"] = ("True", "ChildrenApplied", "the job's children exist")
    else:
        wanted["Created"] = ("False", "Creating", "the job's children are being created")
    if observed.shard_lock_message:
        wanted["ShardCountLocked"] = ("True", "ReshardingUnsupported", observed.shard_lock_message)
    resharded = _find(previous, RESHARDING)
    if observed.resharding:
        wanted[RESHARDING] = observed.resharding
    elif resharded is not None:   # how the last reshard ended stays said
        wanted[RESHARDING] = ("False", resharded.get("reason", ""), resharded.get("message", ""))
    if observed.partition_lock_message:
        wanted["PartitionCountLocked"] = ("True", "RepartitioningUnsupported", observed.partition_lock_message)
    for kind, seen in ((MODEL_DEGRADED, _degraded(observed.figures)), (ROW_BUDGET_REACHED, _row_budget(observed.figures)),
                       (UPDATES_LOST, _updates_lost(observed.figures))):
        before = _find(previous, kind)
        if seen:
            wanted[kind] = ("True", *seen)
        elif before is not None and before.get("status") == "True":
            wanted[kind] = ("True", before.get("reason", ""), before.get("message", ""))
    conditions = []
    for kind, (state, why, text) in wanted.items():
        before = _find(previous, kind)
        changed = before is None or before.get("status") != state
        conditions.append({"type": kind, "status": state, "reason": why, "message": text,
                           "lastTransitionTime": timestamp(now) if changed else before["lastTransitionTime"],
                           "observedGeneration": generation})
    return conditions


def _degraded(figures: Figures) -> tuple[str, str] | None:
    """The chief's verdict on an ended job's model, as (reason, message)."""
    if not figures.degraded_reason:
        return None
    return figures.degraded_reason, figures.degraded_message or figures.degraded_reason


def _row_budget(figures: Figures) -> tuple[str, str] | None:
    """(reason, message) once a shard refused or evicted rows for want of room in its budget."""
    refused, evicted = figures.rows_refused or 0, figures.rows_evicted or 0
    if not refused and not evicted:
        return None
    budget = f"a shard reached its row budget of {figures.row_budget or 0:,} rows " \
             f"(spec.model.embeddings.maxRowsPerShard)"
    if refused:
        return "RowsRefused", f"{budget}: {refused:,} new rows refused, their gradients dropped; raise the " \
            "budget (and the shards' memory limit), or set expireAfterSeconds to evict idle rows"
    return "RowsEvicted", f"{budget}: {evicted:,} rows evicted, those pushed to least recently first"


def _updates_lost(figures: Figures) -> tuple[str, str] | None:
    """(reason, message) once a shard lost applied updates: it came back from a checkpoint,
    or a copy took over, behind the step it had served to the replicas."""
    if not figures.updates_lost:
        return None
    shards = ", ".join(f"shard {shard} {count:,}" for shard, count in sorted(figures.updates_lost.items()))
    return "ShardStateBehind", (f"applied updates lost ({shards}): a shard came back from a checkpoint, or a copy "
                                "took over, behind the step it had served; spec.parameterServers.backups keeps "
                                "copies, spec.training.failOnUpdatesLost fails such a job")


def _find(conditions: list[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == kind), None)
