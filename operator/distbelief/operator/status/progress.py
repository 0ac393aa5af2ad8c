"""How far a job is and when it will be done: status.progress, status.eta, status.throughput.

Pure functions of spec.training, the status being computed, the previous one and the time.
The step rate is measured by the operator itself, from the chief's global step at two
status passes (throughput.sampledStep at throughput.sampledAt, smoothed), so it counts
what the job really applies, whatever the algorithm, the replicas or the partitions; it
restarts when the job was not running (a suspension, a restart from a checkpoint), so
that time stopped never slows the estimate.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from distbelief.runtime import jobspec

# A new rate counts this much against the smoothed one (an exponential moving average).
SMOOTHING = 0.5
# Two samples closer than this are not compared (the step is read once per status pass).
MIN_SAMPLE_SECONDS = 1.0


def timestamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)


def done_fraction(training: jobspec.Training, status: Mapping[str, Any]) -> float | None:
    """The share of the job's work done: status.globalStep of spec.training.maxSteps. A job
    whose data streams by epochs counts its epochs here instead, once its status has one;
    None before the chief has answered."""
    step = status.get("globalStep")
    if step is None:
        return None
    return min(1.0, int(step) / training.max_steps)


def progress_fields(training: jobspec.Training, previous: Mapping[str, Any], status: Mapping[str, Any],
                    *, running: bool, succeeded: bool, now: datetime.datetime) -> dict[str, Any]:
    """progress (percent, one decimal; 100 once Succeeded), throughput, and eta while the
    job runs and its rate is known (None once it no longer does, to remove it)."""
    fraction = done_fraction(training, status)
    if fraction is None:
        return {}
    fields: dict[str, Any] = {"progress": 100.0 if succeeded else round(100 * fraction, 1)}
    step = int(status["globalStep"])
    throughput = measure(previous.get("throughput") or {}, step, running=running, now=now)
    fields["throughput"] = throughput
    rate = throughput.get("stepsPerSecond")
    if running and rate:
        remaining = max(0, training.max_steps - step)
        fields["eta"] = format_seconds(remaining / rate)
    elif "eta" in previous:
        fields["eta"] = None  # removed: the status is merge-patched, an absent key would stay
    return fields


def measure(sample: Mapping[str, Any], step: int, *, running: bool, now: datetime.datetime) -> dict[str, Any]:
    """The new throughput: the rate since the last sample folded into the smoothed one; a
    fresh sample alone when the job is not running or the step went back."""
    fresh = {"sampledStep": step, "sampledAt": timestamp(now)}
    if not running or "sampledAt" not in sample or step < int(sample.get("sampledStep", 0)):
        return fresh
    seconds = (now - parse_timestamp(sample["sampledAt"])).total_seconds()
    if seconds < MIN_SAMPLE_SECONDS:
        return dict(sample)
    rate = (step - int(sample["sampledStep"])) / seconds
    before = sample.get("stepsPerSecond")
    smoothed = rate if before is None else SMOOTHING * rate + (1 - SMOOTHING) * float(before)
    return {**fresh, "stepsPerSecond": round(smoothed, 3)}


def format_seconds(seconds: float) -> str:
    """A duration as a person reads it: 45s, 3m20s, 2h05m, 3d04h."""
    total = int(round(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
