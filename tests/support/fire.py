"""A local-mode job run while a killer SIGKILLs its pods: the chaos tests' harness."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

from distbelief.operator.local import local
from distbelief.operator.validation.job import DistBeliefJob

KillRecord = dict[str, Any]


def run_under_fire(doc: dict[str, Any], output: Path,
                   killer: Callable[[local.LocalRun, threading.Thread], list[KillRecord]],
                   ) -> tuple[local.LocalRun, list[int], list[KillRecord]]:
    """Run a job in local mode (in a thread) while killer(run, thread) SIGKILLs its pods; wait
    for the job's end. Returns the run, its exit code (in a list, empty if it never
    ended) and what the killer recorded."""
    run = local.LocalRun(DistBeliefJob.validated(doc), str(output))
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run.run(progress=False)), daemon=True)
    thread.start()
    try:
        kills = killer(run, thread)
        thread.join(timeout=600)
    finally:
        run.interrupt()
        thread.join(timeout=60)
    return run, codes, kills
