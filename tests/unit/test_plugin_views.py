"""What `kubectl distbelief` prints, from statuses compute_status makes (the operator's and
local mode's own): get's table, describe's screen, top's rates, the pods logs picks, and a
local run's status once it has ended."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest

from distbelief.operator.plugin import pods, top, views
from distbelief.operator.plugin.localjobs import ended
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import scrape
from distbelief.operator.status.status import Observed, compute_status

from support.examples import load_example

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
SECOND = datetime.timedelta(seconds=1)
# A job of 2 shards with a backup each: the StatefulSet's pods 0 and 2 hold shard 0, 1 and 3 shard 1.
SHARD_PODS = [pods.Pod(f"digits-ps-{i}", "ps", ready=i != 3, phase="Running" if i != 3 else "Pending")
              for i in range(4)]
WORKER_PODS = [pods.Pod(f"digits-worker-{x}", "worker", ready=True, restarts=2, phase="Running") for x in "ab"]


def job(backups: int = 1, name: str = "digits") -> DistBeliefJob:
    doc = spec.validate_job(load_example("digits-mlp.yaml"))
    doc["spec"]["training"]["maxSteps"] = 10000
    doc["spec"]["parameterServers"]["backups"] = backups
    doc["metadata"].update(name=name, namespace="ml", creationTimestamp="2026-01-02T03:00:05Z")
    return DistBeliefJob.of(doc)


def observed(job: DistBeliefJob, seen: Observed, now: datetime.datetime) -> DistBeliefJob:
    """The job with the status compute_status makes of what was seen."""
    return dataclasses.replace(job, status=compute_status(job, seen, now))


def running_job(**figures: Any) -> DistBeliefJob:
    """The job after two status passes 10 s apart: 1000 then 2000 steps, shard 1 failed over once."""
    doc = job()
    copies = {0: {"copies": 2, "primary": 0, "failovers": 0}, 1: {"copies": 1, "primary": 1, "failovers": 1}}
    ready = dict(shards_ready=3, workers=2, workers_ready=2, children_created=True)
    for step, seconds in ((1000, -10), (2000, 0)):
        seen = scrape.Figures(global_step=step, accuracy=0.91234, loss=0.3, examples_per_second=12345.6,
                              checkpoint_step=1900, checkpoint_time=(NOW - 3 * SECOND).timestamp(), copies=copies,
                              **figures)
        doc = observed(doc, Observed(**ready, figures=seen), NOW + seconds * SECOND)
    return doc


def test_get_prints_phase_progress_step_accuracy_eta_and_age_per_job() -> None:
    waiting = job(name="fresh")
    table = views.get_table([running_job(), waiting], NOW, namespaces=True).splitlines()
    assert table[0].split() == ["NAMESPACE", "NAME", "PHASE", "PROGRESS", "STEP", "ACCURACY", "ETA", "AGE"]
    assert table[1].split() == ["ml", "digits", "Running", "20%", "2000", "0.9123", "1m20s", "4m00s"]
    assert table[2].split() == ["ml", "fresh", "Pending", "-", "-", "-", "-", "4m00s"]
    assert views.get_table([running_job()], NOW).splitlines()[0].split()[0] == "NAME"


def test_describe_says_why_the_job_is_in_its_phase_how_far_it_is_and_what_holds_each_shard() -> None:
    events = [views.Event("Normal", "Running", "2 shards and 2 replicas ready", "2026-01-02T03:03:05Z"),
              views.Event("Warning", "ShardFailover", "shard 1: digits-ps-3 took over", "2026-01-02T03:04:00Z", 2)]
    screen = views.describe(running_job(), SHARD_PODS + WORKER_PODS, events, NOW).splitlines()
    line = {text.split(":", 1)[0]: text.split(":", 1)[1].strip() for text in screen if not text.startswith(" ")
            and ":" in text}
    assert line["Phase"] == "Running (Training: 2 shards and 2 replicas ready)"
    assert line["Progress"] == "20%, step 2000 of 10000, ETA 1m20s, 100.0 steps/s"
    assert line["Model"] == "accuracy 0.9123, loss 0.3000, examples/s 12,346"
    assert line["Replicas"] == "2/3 ready"
    assert line["Shards"] == "2, 2 copies each; 3/4 pods ready"
    assert line["Checkpoint"] == "step 1900 at 2026-01-02T03:04:02Z (3s ago)"
    shards = [text.split() for text in screen if text.startswith("  0 ") or text.startswith("  1 ")]
    assert shards[0] == ["0", "digits-ps-0", "2", "0", "digits-ps-0", "(ready),", "digits-ps-2", "(ready)"]
    assert shards[1] == ["1", "digits-ps-3", "1", "1", "digits-ps-1", "(ready),", "digits-ps-3", "(Pending)"]
    assert ["digits-worker-a", "worker", "yes", "2", "Running"] in [text.split() for text in screen]
    assert screen[-1].split()[:3] == ["Warning", "ShardFailover", "5s"] and "(x2)" in screen[-1]
    assert "Events:        not recorded here (local mode)" in views.describe(running_job(), [], None, NOW)


def test_a_pending_job_says_what_it_waits_for_and_that_no_step_is_known() -> None:
    doc = observed(job(backups=0), Observed(shards_ready=1, workers=3, workers_ready=1, children_created=False), NOW)
    assert views.phase_line(doc.status) == "Pending (Creating: the job's children are being created)"
    assert views.progress_line(doc.config.spec.training, doc.status) == "no step yet (the chief has not answered)"
    screen = views.describe(doc, SHARD_PODS[:2], [], NOW)
    assert "Shards:        2, 1 copy each; 1/2 pods ready" in screen and "Replicas:      1/3 ready (3 pods)" in screen \
        and "Events:        none" in screen
    assert [text.split()[:4] for text in screen.splitlines() if text.startswith("  1 ")] == \
        [["1", "digits-ps-1", "1", "-"]]


def test_logs_pick_a_role_the_chief_or_every_copy_of_one_shard() -> None:
    doc, every = job(), SHARD_PODS + WORKER_PODS

    def names(**chosen: Any) -> list[str]:
        return [pod.name for pod in pods.select(doc.config, every, **chosen)]

    assert names(role=None, shard=None) == [pod.name for pod in every]
    assert names(role="worker", shard=None) == ["digits-worker-a", "digits-worker-b"]
    assert names(role="chief", shard=None) == ["digits-ps-0"]   # shard 0's first copy, not its backup
    assert names(role=None, shard=1) == names(role="ps", shard=1) == ["digits-ps-1", "digits-ps-3"]
    with pytest.raises(ValueError, match="--shard picks a parameter shard's pods: it goes with --role ps"):
        names(role="worker", shard=0)
    with pytest.raises(ValueError, match="--shard 2: job digits has shards 0 to 1"):
        names(role=None, shard=2)


def test_top_shows_rates_between_two_reads_and_no_rate_for_a_counter_that_went_back() -> None:
    shard, worker = SHARD_PODS[0], WORKER_PODS[0]
    before = scrape.Figures(global_step=100, replica_steps=40, cpu_seconds=1.0, bytes_in=1000, bytes_out=3 << 20)
    after = scrape.Figures(global_step=300, replica_steps=90, cpu_seconds=1.5, bytes_in=5096, bytes_out=7 << 20,
                           resident_memory=67_000_000)
    restarted = scrape.Figures(global_step=5, replica_steps=2, cpu_seconds=0.1, bytes_in=10, bytes_out=10)
    rows = [top.row(top.Sample(pod, first, second, 2.0)) for pod, first, second in
            ((shard, before, after), (worker, before, after), (worker, before, restarted))]
    assert rows[0][1:] == ["ps", "100.0", "25%", "63.9MiB", "2.0KiB/s", "2.0MiB/s", "5.0KiB", "7.0MiB"]
    assert rows[1][2] == "25.0"                                  # a replica's own minibatches
    assert rows[2][2:4] == ["-", "-"] and rows[2][7] == "10B"
    failed = top.row(top.Sample(shard, scrape.Figures(), scrape.Figures(), 2.0, error="400 address not allowed"))
    assert failed[2] == "no answer" and set(failed[3:]) == {"-"}
    assert top.top_table([top.Sample(shard, before, after, 2.0)]).splitlines()[0].split() == \
        ["POD", "ROLE", "STEPS/S", "CPU", "MEMORY", "IN/S", "OUT/S", "IN", "OUT"]


def test_an_ended_local_run_shows_its_report_phase_and_a_killed_one_shows_as_stopped() -> None:
    status = dict(running_job().status)
    interrupted = ended(status, {"phase": "Suspended", "reason": "Interrupted: checkpoints kept; run again to resume"})
    assert views.phase_line(interrupted) == "Suspended (Interrupted: checkpoints kept; run again to resume)"
    assert "eta" not in interrupted and interrupted["workers"]["ready"] == interrupted["parameterServers"]["ready"] == 0
    killed = ended(status, None)
    assert views.phase_line(killed) == "Stopped (NoReport: the run ended without writing its report (killed?))"
    finished = dict(status, phase="Succeeded")
    assert ended(finished, {"phase": "Succeeded", "reason": "MaxStepsReached"})["conditions"] == status["conditions"]
