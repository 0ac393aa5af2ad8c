"""What `kubectl distbelief top` prints: each pod's step rate, CPU, memory and traffic, from
two reads of its metrics endpoint `seconds` apart (pure functions of what was read).

A shard's steps are the updates it applied (distbelief_global_step), a replica's the
minibatches it computed; bytes are what the pod's process moved over the job's transport.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from distbelief.operator.plugin.pods import Pod
from distbelief.operator.plugin.views import NONE, table
from distbelief.operator.status.scrape import Figures
from distbelief.runtime import contract

UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


@dataclasses.dataclass(frozen=True)
class Sample:
    """Two reads of one pod's metrics, `seconds` apart (empty Figures: it did not answer)."""

    pod: Pod
    first: Figures
    second: Figures
    seconds: float
    error: str | None = None   # why a read failed


def steps(pod: Pod, figures: Figures) -> int | None:
    return figures.global_step if pod.role == contract.ROLE_PS else figures.replica_steps


def rate(before: float | None, after: float | None, seconds: float) -> float | None:
    """Per second between two readings of a counter; None without both, or when it went
    back (the pod restarted in between)."""
    if before is None or after is None or after < before or seconds <= 0:
        return None
    return (after - before) / seconds


def size(value: float | None, suffix: str = "") -> str:
    """Bytes as a person reads them: 812B, 3.4MiB, 1.2GiB."""
    if value is None:
        return NONE
    unit = 0
    while abs(value) >= 1024 and unit < len(UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.0f}{UNITS[unit]}{suffix}" if unit == 0 else f"{value:.1f}{UNITS[unit]}{suffix}"


def row(sample: Sample) -> list[str]:
    pod, first, second, seconds = sample.pod, sample.first, sample.second, sample.seconds
    if sample.error or second == Figures():
        return [pod.name, pod.role, "no answer", NONE, NONE, NONE, NONE, NONE, NONE]
    step_rate = rate(steps(pod, first), steps(pod, second), seconds)
    cpu = rate(first.cpu_seconds, second.cpu_seconds, seconds)
    return [pod.name, pod.role, NONE if step_rate is None else f"{step_rate:.1f}",
            NONE if cpu is None else f"{100 * cpu:.0f}%", size(second.resident_memory),
            size(rate(first.bytes_in, second.bytes_in, seconds), "/s"),
            size(rate(first.bytes_out, second.bytes_out, seconds), "/s"),
            size(second.bytes_in), size(second.bytes_out)]


def top_table(samples: Sequence[Sample]) -> str:
    header = ["POD", "ROLE", "STEPS/S", "CPU", "MEMORY", "IN/S", "OUT/S", "IN", "OUT"]
    return "\n".join(table([header, *map(row, samples)]))
