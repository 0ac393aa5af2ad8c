"""status.progress, status.eta and status.throughput: how far a job is and when it will be done."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import scrape
from distbelief.operator.status.progress import format_seconds
from distbelief.operator.status.status import Observed, compute_status

from support.examples import load_example

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
RUNNING = {"shards_ready": 2, "workers_ready": 3, "children_created": True}


def job(**status: Any) -> DistBeliefJob:
    doc = spec.validate_job(load_example("digits-mlp.yaml"))
    doc["spec"]["training"]["maxSteps"] = 10000
    doc["status"] = status
    return DistBeliefJob.of(doc)


def at(step: int, seconds: float, previous: dict[str, Any] | None = None, **observed: Any) -> dict[str, Any]:
    figures = scrape.Figures(global_step=step)
    return compute_status(job(**(previous or {})), Observed(**{**RUNNING, **observed}, figures=figures),
                          NOW + datetime.timedelta(seconds=seconds))


def test_progress_is_the_share_of_max_steps_and_eta_follows_the_measured_rate() -> None:
    first = at(1000, 0)
    assert first["progress"] == 10.0
    assert "eta" not in first                                   # one sample: no rate yet
    second = at(2000, 10, first)                                # 100 steps/s, 8000 to go
    assert second["throughput"]["stepsPerSecond"] == 100.0
    assert second["progress"] == 20.0 and second["eta"] == "1m20s"
    third = at(2500, 20, second)                                # 50 steps/s now: smoothed to 75
    assert third["throughput"]["stepsPerSecond"] == 75.0
    assert third["eta"] == format_seconds(7500 / 75)


def test_time_suspended_does_not_slow_the_estimate() -> None:
    running = at(2000, 10, at(1000, 0))
    suspended = compute_status(job(**running), Observed(queued=("Queued", "waiting"),
                                                         figures=scrape.Figures(global_step=2000)),
                               NOW + datetime.timedelta(seconds=600))
    assert suspended["phase"] == "Suspended" and suspended["eta"] is None   # removed from the stored status
    assert "stepsPerSecond" not in suspended["throughput"]      # measured afresh after it
    resumed = at(2100, 601, suspended)
    assert resumed["throughput"]["stepsPerSecond"] == 100.0


def test_a_step_that_goes_back_restarts_the_measure() -> None:
    before = at(2000, 10, at(1000, 0))
    after = at(1500, 20, before)                                # restored from an older checkpoint
    assert "stepsPerSecond" not in after["throughput"] and after["progress"] == 15.0


def test_a_succeeded_job_is_done_whatever_its_step() -> None:
    figures = scrape.Figures(global_step=4000, finished_outcome="Succeeded", finished_reason="TargetAccuracyReached")
    done = compute_status(job(), Observed(**RUNNING, figures=figures), NOW)
    assert done["phase"] == "Succeeded" and done["progress"] == 100.0 and "eta" not in done


def test_no_progress_before_the_chief_answers() -> None:
    status = compute_status(job(), Observed(**RUNNING), NOW)
    assert "progress" not in status and "eta" not in status


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (45.4, "45s"), (200, "3m20s"), (7500, "2h05m"),
                                           (3 * 86400 + 4 * 3600 + 59, "3d04h")])
def test_durations_read_as_a_person_reads_them(seconds: float, text: str) -> None:
    assert format_seconds(seconds) == text
