"""Local runs driven from a test: run a job to its end, or suspend it (as Ctrl-C does) once
its chief reached a step; read what its shards' logs say they restored."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable

from distbelief.operator.local import local, report
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import scrape
from distbelief.runtime import contract
from support.waiting import eventually


def run_job(doc: dict[str, Any], output: Path) -> tuple[int, dict[str, Any]]:
    """Run the job in output to its end: its exit code and its report."""
    code = local.LocalRun(DistBeliefJob.validated(doc), str(output)).run(progress=False)
    return code, json.loads((output / report.REPORT_FILE).read_text())


def wait_for_step(port: int, step: int, timeout: float = 120) -> int:
    """The chief's global step (its metrics on port) once it reached step."""
    def reached() -> int:
        seen = scrape.read(f"http://127.0.0.1:{port}/metrics").global_step or 0
        return seen if seen >= step else 0
    return eventually(reached, timeout, interval=0.2, what=f"global step {step}")


def run_while(doc: dict[str, Any], output: Path, act: Callable[[local.LocalRun], None], *,
              timeout: float = 240) -> tuple[int, dict[str, Any]]:
    """Run the job in output, do act(run) meanwhile, and wait for the run's end (timeout:
    then it is interrupted, as Ctrl-C does): its exit code and its report."""
    run = local.LocalRun(DistBeliefJob.validated(doc), str(output))
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run.run(progress=False)))
    thread.start()
    try:
        act(run)
        thread.join(timeout=timeout)
    finally:
        run.interrupt()
        thread.join(timeout=60)
    return codes[0], json.loads((output / report.REPORT_FILE).read_text())


def chief_port(run: local.LocalRun) -> int:
    return run.shards[0].ports[contract.METRICS_PORT_NAME]


def suspend_at(doc: dict[str, Any], output: Path, step: int) -> tuple[int, dict[str, Any]]:
    """Run the job in output and interrupt it (Ctrl-C) once it reached step: its exit code
    and its report."""
    def interrupt(run: local.LocalRun) -> None:
        wait_for_step(chief_port(run), step)
        run.interrupt()
    return run_while(doc, output, interrupt, timeout=60)


def restored_steps(log_path: Path) -> list[int]:
    """The step of every checkpoint a shard's log says it restored."""
    return [int(line.split("step=")[1].split()[0]) for line in log_path.read_text().splitlines()
            if "event=restored" in line]
