"""compute_status: the job's status from what the operator observed (a pure function)."""

from __future__ import annotations

import datetime
from typing import Any

import prometheus_client as prom

from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import scrape
from distbelief.operator.status.status import Observed, compute_status, pod_failures, timestamp
from distbelief.runtime.observe.metrics import ChiefMetrics, CoordinatorMetrics, DispenserMetrics, ShardMetrics

from support.examples import load_example

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
LATER = NOW + datetime.timedelta(seconds=30)


def job(*, suspend: bool = False, **status: Any) -> DistBeliefJob:
    doc = spec.validate_job(load_example("digits-mlp.yaml"))
    doc["metadata"]["generation"] = 4
    doc["spec"]["runPolicy"]["suspend"] = suspend
    doc["status"] = status
    return DistBeliefJob.of(doc)


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_pending_until_every_shard_and_a_replica_are_ready() -> None:
    pending = compute_status(job(), Observed(shards_ready=1, workers=3, workers_ready=3, children_created=True), NOW)
    assert pending["phase"] == "Pending"
    running = compute_status(job(), Observed(shards_ready=2, workers=3, workers_ready=1, children_created=True), NOW)
    assert running["phase"] == "Running"
    assert condition(running, "Running")["status"] == "True"
    assert condition(running, "Created")["status"] == "True"
    assert running["observedGeneration"] == 4
    assert running["selector"] == "distbelief.io/job=digits,distbelief.io/role=worker"
    assert running["workers"] == {"replicas": 3, "ready": 1}
    assert running["parameterServers"] == {"shards": 2, "ready": 2}


def test_training_figures_come_from_the_chief_and_survive_its_silence() -> None:
    figures = scrape.Figures(global_step=1200, loss=0.1234567, accuracy=0.97, examples_per_second=5000.0,
                             checkpoint_step=1100, checkpoint_time=NOW.timestamp())
    first = compute_status(job(), Observed(shards_ready=2, workers_ready=3, figures=figures), NOW)
    assert (first["globalStep"], first["accuracy"], first["loss"]) == (1200, 0.97, 0.123457)
    assert first["lastCheckpoint"] == {"step": 1100, "time": timestamp(NOW)}
    silent = compute_status(job(**first), Observed(shards_ready=2, workers_ready=3), LATER)
    assert silent["globalStep"] == 1200 and silent["accuracy"] == 0.97


def test_a_sandblaster_jobs_objective_is_read_once_it_has_evaluated() -> None:
    registry = prom.CollectorRegistry()
    coordinator = CoordinatorMetrics(registry)
    ShardMetrics(registry, 0).global_step.set(3)
    assert scrape.parse(prom.generate_latest(registry).decode()).objective is None  # no evaluation yet
    coordinator.evaluations.inc()
    coordinator.objective.set(0.4321)
    figures = scrape.parse(prom.generate_latest(registry).decode())
    assert figures.objective == 0.4321
    status = compute_status(job(), Observed(shards_ready=2, workers_ready=3, figures=figures), NOW)
    assert (status["globalStep"], status["objective"]) == (3, 0.4321)
    downpour = scrape.Figures(global_step=5, loss=0.5)
    assert "objective" not in compute_status(job(), Observed(shards_ready=2, workers_ready=3, figures=downpour), NOW)


def test_a_streamed_jobs_epoch_comes_from_the_dispensers_gauge() -> None:
    registry = prom.CollectorRegistry()
    ShardMetrics(registry, 0).global_step.set(40)
    DispenserMetrics(registry, lambda: 2.25)
    figures = scrape.parse(prom.generate_latest(registry).decode())
    status = compute_status(job(), Observed(shards_ready=2, workers_ready=3, figures=figures), NOW)
    assert status["epoch"] == 2.25
    silent = compute_status(job(**status), Observed(shards_ready=2, workers_ready=3), LATER)
    assert silent["epoch"] == 2.25
    assert "epoch" not in compute_status(job(), Observed(figures=scrape.Figures(global_step=5)), NOW)


def test_the_chiefs_verdict_finishes_the_job_for_good() -> None:
    figures = scrape.Figures(global_step=8000, accuracy=0.98, finished_reason="MaxStepsReached",
                             finished_outcome="Succeeded")
    done = compute_status(job(startTime=timestamp(NOW)), Observed(shards_ready=2, figures=figures), LATER)
    assert done["phase"] == "Succeeded"
    assert done["completionTime"] == timestamp(LATER)
    assert condition(done, "Succeeded")["reason"] == "MaxStepsReached"
    assert condition(done, "Running")["status"] == "False"
    # Once finished, nothing observed later (pods gone, chief silent) changes the verdict.
    after = compute_status(job(**done), Observed(), LATER + datetime.timedelta(hours=1))
    assert after["phase"] == "Succeeded" and after["completionTime"] == timestamp(LATER)
    assert condition(after, "Succeeded")["lastTransitionTime"] == timestamp(LATER)


def test_a_crash_looping_shard_fails_the_job() -> None:
    limit = job().config.spec.run_policy.backoff_limit
    at_limit = compute_status(job(), Observed(shards_ready=2, workers_ready=1, shard_restarts=limit), NOW)
    assert at_limit["phase"] == "Running"
    over = compute_status(job(), Observed(shard_restarts=limit + 1), NOW)
    assert over["phase"] == "Failed"
    assert condition(over, "Failed")["reason"] == "BackoffLimitExceeded"


def test_a_silent_job_past_its_max_duration_fails() -> None:
    doc = job(startTime=timestamp(NOW))
    duration = 600  # examples/digits-mlp.yaml: maxDuration 10m
    still = compute_status(doc, Observed(), NOW + datetime.timedelta(seconds=duration + 30))
    assert still["phase"] == "Pending"
    late = compute_status(doc, Observed(), NOW + datetime.timedelta(seconds=duration + 120))
    assert late["phase"] == "Failed" and condition(late, "Failed")["reason"] == "DeadlineExceeded"


def test_suspended_and_shard_lock_conditions() -> None:
    suspended = compute_status(job(suspend=True), Observed(shard_lock_message="shards changed from 2 to 3"), NOW)
    assert suspended["phase"] == "Suspended"
    assert condition(suspended, "Suspended")["status"] == "True"
    assert condition(suspended, "ShardCountLocked")["message"] == "shards changed from 2 to 3"


def test_a_refused_partition_count_change_is_a_condition_of_its_own() -> None:
    status = compute_status(job(), Observed(partition_lock_message="partitions changed from 2 to 3"), NOW)
    locked = condition(status, "PartitionCountLocked")
    assert (locked["status"], locked["reason"]) == ("True", "RepartitioningUnsupported")
    assert locked["message"] == "partitions changed from 2 to 3"
    assert "PartitionCountLocked" not in {c["type"] for c in compute_status(job(), Observed(), NOW)["conditions"]}


def test_transition_times_move_only_when_a_condition_changes() -> None:
    running = compute_status(job(), Observed(shards_ready=2, workers_ready=1, children_created=True), NOW)
    again = compute_status(job(**running), Observed(shards_ready=2, workers_ready=2, children_created=True), LATER)
    assert condition(again, "Running")["lastTransitionTime"] == timestamp(NOW)
    assert again["startTime"] == running["startTime"]


def _pod(name: str, role: str, *, restarts: int = 0, state: dict | None = None,
         last: dict | None = None) -> dict[str, Any]:
    container = {"name": role, "restartCount": restarts, "state": state or {"running": {}},
                 "lastState": last or {}}
    return {"metadata": {"name": name, "labels": {"distbelief.io/role": role}},
            "status": {"containerStatuses": [container]}}


def test_a_pod_that_exited_with_a_config_error_fails_the_job_at_once() -> None:
    log_tail = "2026-01-02 INFO loading\nerror: npz:/data/x.npz: x holds 3 non-finite values\n"
    pods = [_pod("digits-ps-0", "ps"),
            _pod("digits-worker-abc", "worker", state={"terminated": {"exitCode": 2, "message": log_tail}})]
    seen = pod_failures(pods)
    assert seen["invalid_config"] == "digits-worker-abc: error: npz:/data/x.npz: x holds 3 non-finite values"
    failed = compute_status(job(), Observed(shards_ready=2, workers_ready=2, **seen), NOW)
    assert failed["phase"] == "Failed"
    assert condition(failed, "Failed")["reason"] == "InvalidConfig"
    assert "x holds 3 non-finite values" in condition(failed, "Failed")["message"]


def test_a_config_error_in_a_restarted_container_counts_too() -> None:
    pods = [_pod("digits-ps-1", "ps", restarts=1, last={"terminated": {"exitCode": 2, "message": "error: bad"}})]
    assert pod_failures(pods)["invalid_config"] == "digits-ps-1: error: bad"


def test_a_crash_looping_shard_says_how_it_last_ended() -> None:
    pods = [_pod("digits-ps-0", "ps", restarts=1),
            _pod("digits-ps-1", "ps", restarts=5, last={"terminated": {"exitCode": 1, "message": "error: gone"}}),
            _pod("digits-worker-a", "worker", restarts=9)]
    seen = pod_failures(pods)
    assert seen["shard_restarts"] == 5 and seen["invalid_config"] is None
    failed = compute_status(job(), Observed(**seen), NOW)
    message = condition(failed, "Failed")["message"]
    assert condition(failed, "Failed")["reason"] == "BackoffLimitExceeded"
    assert "digits-ps-1 last exited with code 1: error: gone" in message


def test_shards_restarted_after_ending_cleanly_do_not_count_toward_the_backoff_limit() -> None:
    """A shard exits 0 once it has seen the job done; restartPolicy Always starts it again
    until the operator reads the chief's outcome. Those restarts are not failures."""
    done = {"terminated": {"exitCode": 0, "reason": "Completed"}}
    pods = [_pod("digits-ps-0", "ps", restarts=6, last=done), _pod("digits-ps-1", "ps", restarts=5, last=done)]
    seen = pod_failures(pods)
    assert seen["shard_restarts"] == 0 and seen["restarts"] == 11
    assert compute_status(job(), Observed(shards_ready=2, workers_ready=2, **seen), NOW)["phase"] == "Running"
    crashed = pods + [_pod("digits-ps-2", "ps", restarts=4, last={"terminated": {"exitCode": 1}})]
    assert pod_failures(crashed)["shard_restarts"] == 4


def test_the_status_counts_every_container_restart_and_keeps_the_count_once_the_pods_are_gone() -> None:
    pods = [_pod("digits-ps-0", "ps", restarts=1), _pod("digits-worker-a", "worker", restarts=2)]
    running = compute_status(job(), Observed(shards_ready=2, workers_ready=2, **pod_failures(pods)), NOW)
    assert running["restarts"] == 3
    finished = compute_status(job(**running), Observed(**pod_failures([])), LATER)
    assert finished["restarts"] == 3
    assert "restarts" not in compute_status(job(), Observed(), NOW)


def test_a_shard_the_oom_killer_keeps_ending_says_so() -> None:
    pods = [_pod("digits-ps-0", "ps", restarts=4, last={"terminated": {"exitCode": 137, "reason": "OOMKilled"}})]
    failed = compute_status(job(), Observed(**pod_failures(pods)), NOW)
    assert "digits-ps-0 last exited with code 137 (OOMKilled: over its memory limit)" in \
        condition(failed, "Failed")["message"]


def test_a_replica_whose_loss_stays_non_finite_fails_the_job() -> None:
    seen = "digits-worker-1 computed a training loss of nan at global step 17"
    failed = compute_status(job(), Observed(shards_ready=2, workers_ready=3, non_finite_loss=seen), NOW)
    assert failed["phase"] == "Failed"
    assert condition(failed, "Failed")["reason"] == "NonFiniteLoss" and condition(failed, "Failed")["message"] == seen


def test_a_two_class_jobs_auc_reaches_the_status_and_other_jobs_have_none() -> None:
    registry = prom.CollectorRegistry()
    chief = ChiefMetrics(registry)
    ShardMetrics(registry, 0).global_step.set(5)
    assert scrape.parse(prom.generate_latest(registry).decode()).auc is None  # not evaluated, or not two-class
    chief.auc.set(0.8125)
    figures = scrape.parse(prom.generate_latest(registry).decode())
    assert figures.auc == 0.8125
    status = compute_status(job(), Observed(shards_ready=2, workers_ready=3, figures=figures), NOW)
    assert status["auc"] == 0.8125
    silent = compute_status(job(**status), Observed(shards_ready=2, workers_ready=3), LATER)
    assert silent["auc"] == 0.8125


def test_a_replica_that_exited_on_a_non_finite_loss_fails_the_job_on_a_cluster() -> None:
    message = "INFO x\nerror: the training loss was nan for 3 pushes in a row, at global step 17\n"
    pods = [_pod("digits-ps-0", "ps"),
            _pod("digits-worker-abc", "worker", state={"terminated": {"exitCode": 3, "message": message}})]
    seen = pod_failures(pods)
    assert seen["non_finite_loss"] == "digits-worker-abc: error: the training loss was nan for 3 pushes in a row, " \
                                      "at global step 17"
    failed = compute_status(job(), Observed(shards_ready=2, workers_ready=2, **seen), NOW)
    assert condition(failed, "Failed")["reason"] == "NonFiniteLoss"


def test_each_shards_copies_come_from_the_chief_and_fit_the_crd() -> None:
    """With backups the chief reports each shard's copies in sync, its primary's copy rank and
    its failovers; the status names the primary's pod (copy r of shard i is pod r x shards + i)."""
    registry = prom.CollectorRegistry()
    chief = ChiefMetrics(registry)
    ShardMetrics(registry, 0).global_step.set(7)
    for shard, (copies, primary, failovers) in enumerate([(2, 1, 3), (1, 0, 0)]):
        chief.shard_copies.labels(shard=str(shard)).set(copies)
        chief.shard_primary.labels(shard=str(shard)).set(primary)
        chief.shard_failovers.labels(shard=str(shard)).set(failovers)
    figures = scrape.parse(prom.generate_latest(registry).decode())
    status = compute_status(job(), Observed(shards_ready=4, workers_ready=3, figures=figures), NOW)
    assert status["shards"] == {"0": {"copies": 2, "primary": "digits-ps-2", "failovers": 3},
                                "1": {"copies": 1, "primary": "digits-ps-1", "failovers": 0}}
    spec.validate_job(job(**status).manifest())  # the CRD's status schema keeps the field
    silent = compute_status(job(**status), Observed(shards_ready=4, workers_ready=3), LATER)
    assert silent["shards"] == status["shards"]
    without = compute_status(job(), Observed(shards_ready=2, workers_ready=3, figures=scrape.Figures(global_step=7)),
                             NOW)
    assert "shards" not in without


def test_conditions_have_the_shape_of_metav1_condition() -> None:
    status = compute_status(job(), Observed(shards_ready=2, workers_ready=1, children_created=True), NOW)
    for item in status["conditions"]:
        assert set(item) == {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
        assert item["reason"] and item["observedGeneration"] == 4
    assert (condition(status, "Succeeded")["reason"], condition(status, "Succeeded")["message"]) == (
        "Running", "the job is Running")


def test_a_spec_the_rules_refuse_fails_the_job_for_good() -> None:
    failed = compute_status(job(), Observed(invalid_spec="spec.model.partitions: needs downpour"), NOW)
    assert failed["phase"] == "Failed"
    assert (condition(failed, "Failed")["reason"], condition(failed, "Failed")["message"]) == (
        "InvalidSpec", "spec.model.partitions: needs downpour")
    assert compute_status(job(**failed), Observed(shards_ready=2, workers_ready=1), LATER)["phase"] == "Failed"


def test_a_refusal_to_create_the_children_is_the_created_condition() -> None:
    blocked = compute_status(job(), Observed(blocked=("ForeignObject", "StatefulSet/digits-ps is not ours")), NOW)
    assert blocked["phase"] == "Pending"
    created = condition(blocked, "Created")
    assert (created["status"], created["reason"], created["message"]) == (
        "False", "ForeignObject", "StatefulSet/digits-ps is not ours")


def test_updates_a_shard_lost_are_a_warning_condition_that_stays_and_names_the_shards() -> None:
    registry = prom.CollectorRegistry()
    chief = ChiefMetrics(registry)
    ShardMetrics(registry, 0).global_step.set(9)
    chief.updates_lost.labels(shard="0").set(0)
    figures = scrape.parse(prom.generate_latest(registry).decode())
    assert figures.updates_lost is None
    clean = compute_status(job(), Observed(shards_ready=2, workers_ready=3, figures=figures), NOW)
    assert all(c["type"] != "UpdatesLost" for c in clean["conditions"])
    chief.updates_lost.labels(shard="1").set(1668)
    figures = scrape.parse(prom.generate_latest(registry).decode())
    assert figures.updates_lost == {1: 1668}
    lossy = compute_status(job(), Observed(shards_ready=2, workers_ready=3, figures=figures), NOW)
    lost = condition(lossy, "UpdatesLost")
    assert (lost["status"], lost["reason"]) == ("True", "ShardStateBehind")
    assert lost["message"].startswith("applied updates lost (shard 1 1,668)")
    assert lossy["phase"] == "Running"   # the condition tells; spec.training.failOnUpdatesLost fails the job
    silent = compute_status(job(**lossy), Observed(shards_ready=2, workers_ready=3), LATER)
    assert condition(silent, "UpdatesLost")["status"] == "True"
