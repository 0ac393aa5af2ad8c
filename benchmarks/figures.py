"""What every benchmark reports per figure (the median of its runs, with the min and max),
and how a run that crashes is retried once and then recorded as failed."""
from __future__ import annotations

import functools
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
ATTEMPTS = 2  # a crashed run is retried once


class RunFailed(Exception):
    """A run that crashed or produced no figure: what ran, and the exit code of its child
    process (None when none exited non-zero)."""

    def __init__(self, what: str, exit_code: int | None) -> None:
        super().__init__(what if exit_code is None else f"{what}: exit code {exit_code}")
        self.exit_code = exit_code


def exit_code(exc: Exception) -> int | None:
    """The exit code a failed run reports; None for one that was stopped for overrunning."""
    if isinstance(exc, RunFailed):
        return exc.exit_code
    if isinstance(exc, subprocess.CalledProcessError):
        return exc.returncode
    return None


def retried(what: str, run: Callable[[], T], failures: list[dict], attempts: int = ATTEMPTS) -> T | None:
    """run()'s result; a run that crashes is tried again, up to `attempts` in all. When every
    attempt crashed, the last one is recorded in `failures` (with its exit code) and the
    result is None."""
    for attempt in range(1, attempts + 1):
        try:
            return run()
        except (RunFailed, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            last = exc
            print(f"{what}: attempt {attempt} of {attempts} failed: {exc}", file=sys.stderr, flush=True)
    failures.append({"run": what, "exit_code": exit_code(last), "reason": str(last), "attempts": attempts})
    return None


def interleaved(runs: int, measures: dict[str, Callable[[int], T]], failures: list[dict],
                what: str = "") -> dict[str, list[T | None]]:
    """Every measure once per run (called with the run's index), in turn, so drift in the
    machine's load hits all alike. Each is retried(); a run that crashed twice is None in its
    list and recorded in failures."""
    values: dict[str, list[T | None]] = {name: [] for name in measures}
    for run in range(runs):
        for name, measure in measures.items():
            values[name].append(retried(f"{what}{name} run {run + 1}", functools.partial(measure, run), failures))
    return values


def summarize(runs: list[float | None]) -> dict:
    """median, min and max of the runs that produced a value; None for each when none did."""
    runs = [r for r in runs if r is not None]
    if not runs:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def fmt(s: dict, spec: str = ".2f") -> str:
    """median [min-max], or "failed" for a figure no run produced."""
    if s["median"] is None:
        return "failed"
    return f"{s['median']:{spec}} [{s['min']:{spec}}-{s['max']:{spec}}]"


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return cores
    return cores if quota == "max" else max(1, min(cores, math.ceil(int(quota) / int(period))))


def save(results: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=2) + "\n")


def save_group(results: dict, key: str, path: str | None) -> None:
    """Put results under `key` in the JSON file at path, keeping its other groups."""
    if path:
        file = Path(path)
        merged = json.loads(file.read_text()) if file.exists() else {}
        merged[key] = results
        file.write_text(json.dumps(merged, indent=2) + "\n")
