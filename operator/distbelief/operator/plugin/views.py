"""What `kubectl distbelief get` and `describe` print: pure functions of the job as stored
(spec and status, as the operator writes it or local mode computes it), its pods, its
Events and the time."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from distbelief.operator.plugin.pods import Pod, shard_of
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status.progress import format_seconds, parse_timestamp
from distbelief.runtime import jobspec

NONE = "-"


@dataclasses.dataclass(frozen=True)
class Event:
    type: str
    reason: str
    message: str
    time: str | None = None   # the last time it happened, as the API writes it
    count: int = 1


def event_from_manifest(event: Mapping[str, Any]) -> Event:
    """A core v1 Event as the API server stores it."""
    when = event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp")
    return Event(type=event.get("type", ""), reason=event.get("reason", ""), message=event.get("message", ""),
                 time=when, count=int(event.get("count") or 1))


def table(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Rows as columns padded to their widest cell, three spaces apart, as kubectl prints."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "   ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def age(timestamp: str | None, now: datetime.datetime) -> str:
    """How long ago an API timestamp was (2026-01-01T00:00:00Z, fractions allowed)."""
    if not timestamp:
        return NONE
    when = parse_timestamp(timestamp[:19] + "Z")
    return format_seconds(max(0.0, (now - when).total_seconds()))


def _number(value: Any, form: str) -> str:
    return NONE if value is None else format(value, form)


def get_table(jobs: Sequence[DistBeliefJob], now: datetime.datetime, *, namespaces: bool = False) -> str:
    """One line per job: phase, progress, step, held-out accuracy, ETA, age."""
    header = (["NAMESPACE"] if namespaces else []) + ["NAME", "PHASE", "PROGRESS", "STEP", "ACCURACY", "ETA", "AGE"]
    rows = [header]
    for job in jobs:
        status = job.status
        progress = status.get("progress")
        rows.append(([job.config.namespace] if namespaces else []) + [
            job.config.name, status.get("phase") or "Pending",
            NONE if progress is None else f"{progress:g}%",
            _number(status.get("globalStep"), "d"), _number(status.get("accuracy"), ".4f"),
            status.get("eta") or NONE, age(job.created or status.get("startTime"), now)])
    return "\n".join(table(rows))


def phase_line(status: Mapping[str, Any]) -> str:
    """The phase, and why: the reason and message of the condition of that name."""
    phase = status.get("phase") or "Pending"
    condition = next((c for c in status.get("conditions") or [] if c.get("type") == phase), None)
    if condition is None:
        pending = next((c for c in status.get("conditions") or [] if c.get("type") == "Created"
                        and c.get("status") != "True"), None)
        return f"{phase} ({pending['reason']}: {pending.get('message', '')})" if pending else phase
    return f"{phase} ({condition.get('reason', '')}: {condition.get('message', '')})"


def progress_line(training: jobspec.Training, status: Mapping[str, Any]) -> str:
    """Percent done, the step of maxSteps, the ETA and the step rate the operator measured."""
    if status.get("globalStep") is None:
        return "no step yet (the chief has not answered)"
    rate = (status.get("throughput") or {}).get("stepsPerSecond")
    parts = [f"{status.get('progress', 0):g}%", f"step {status['globalStep']} of {training.max_steps}"]
    if status.get("eta"):
        parts.append(f"ETA {status['eta']}")
    if rate:
        parts.append(f"{rate:,.1f} steps/s")
    return ", ".join(parts)


def figures_line(status: Mapping[str, Any]) -> str:
    """The chief's held-out figures and the examples/s."""
    parts = [f"{label} {format(status[key], form)}" for key, label, form in (
        ("accuracy", "accuracy", ".4f"), ("loss", "loss", ".4f"), ("auc", "AUC", ".4f"),
        ("objective", "objective", ".5g"), ("examplesPerSecond", "examples/s", ",.0f"), ("epoch", "epoch", "g"))
        if status.get(key) is not None]
    return ", ".join(parts) if parts else "no evaluation yet"


def checkpoint_line(status: Mapping[str, Any], now: datetime.datetime) -> str:
    last = status.get("lastCheckpoint")
    if not last:
        return "none yet"
    return f"step {last['step']} at {last['time']} ({age(last['time'], now)} ago)"


def shard_lines(job: DistBeliefJob, pods: Sequence[Pod]) -> list[str]:
    """Each shard: its primary (status.shards with backups, else its one pod), its copies in
    sync, failovers, and its pods with their readiness."""
    servers, reported = job.config.spec.parameter_servers, job.status.get("shards") or {}
    shards, backups = servers.shards, servers.backups
    placed = [(where, pod) for pod in pods if (where := shard_of(job.config, pod)) is not None]
    rows = [["SHARD", "PRIMARY", "IN SYNC", "FAILOVERS", "PODS"]]
    for shard in range(shards):
        copies = sorted((rank, pod) for (index, rank), pod in placed if index == shard)
        seen = reported.get(str(shard)) or {}
        primary = seen.get("primary") or (copies[0][1].name if copies and not backups else NONE)
        rows.append([str(shard), primary, _number(seen.get("copies"), "d") if backups else "1",
                     _number(seen.get("failovers"), "d") if backups else NONE,
                     ", ".join(f"{pod.name} ({'ready' if pod.ready else pod.phase or 'not ready'})"
                               for _, pod in copies) or "no pods"])
    ready = (job.status.get("parameterServers") or {}).get("ready", 0)
    title = f"Shards:        {shards}, {servers.copies} cop{'ies' if backups else 'y'} each; " \
            f"{ready}/{shards * servers.copies} pods ready"
    return [title, *table(rows, indent="  ")]


def pod_lines(pods: Sequence[Pod]) -> list[str]:
    if not pods:
        return ["Pods:          none"]
    rows = [["NAME", "ROLE", "READY", "RESTARTS", "PHASE"]]
    rows += [[pod.name, pod.role, "yes" if pod.ready else "no", str(pod.restarts), pod.phase or NONE] for pod in pods]
    return ["Pods:", *table(rows, indent="  ")]


def condition_lines(status: Mapping[str, Any], now: datetime.datetime) -> list[str]:
    conditions = status.get("conditions") or []
    if not conditions:
        return ["Conditions:    none"]
    rows = [["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"]]
    rows += [[c.get("type", ""), c.get("status", ""), c.get("reason", ""), age(c.get("lastTransitionTime"), now),
              c.get("message", "")] for c in conditions]
    return ["Conditions:", *table(rows, indent="  ")]


def event_lines(events: Sequence[Event] | None, now: datetime.datetime, *, limit: int = 10) -> list[str]:
    """The last `limit` Events, oldest first; None: the source keeps no Events."""
    if events is None:
        return ["Events:        not recorded here (local mode)"]
    if not events:
        return ["Events:        none"]
    rows = [["TYPE", "REASON", "AGE", "MESSAGE"]]
    rows += [[e.type, e.reason, age(e.time, now) + (f" (x{e.count})" if e.count > 1 else ""), e.message]
             for e in list(events)[-limit:]]
    return ["Events:", *table(rows, indent="  ")]


def describe(job: DistBeliefJob, pods: Sequence[Pod], events: Sequence[Event] | None,
             now: datetime.datetime) -> str:
    """One screen on what the job is doing: phase and why, progress and ETA, the model's
    figures, replicas, shards and their copies, pods, last checkpoint, conditions, Events."""
    spec, status = job.config.spec, job.status
    workers = status.get("workers") or {}
    lines = [
        f"Name:          {job.config.name}",
        f"Namespace:     {job.config.namespace}",
        f"Phase:         {phase_line(status)}",
        f"Progress:      {progress_line(spec.training, status)}",
        f"Model:         {figures_line(status)}",
        f"Replicas:      {workers.get('ready', 0)}/{spec.workers.replicas} ready"
        + (f" ({workers['replicas']} pods)" if workers.get("replicas") not in (None, workers.get("ready")) else ""),
        *shard_lines(job, pods),
        f"Checkpoint:    {checkpoint_line(status, now)}",
        f"Restarts:      {status.get('restarts', 0)}",
        *pod_lines(pods),
        *condition_lines(status, now),
        *event_lines(events, now),
    ]
    return "\n".join(lines)
