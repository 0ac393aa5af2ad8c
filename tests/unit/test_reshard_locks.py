"""The operator's side of a changed shard count, as pure functions: which changes are
followed (and hold the job) or refused (cluster/locks.py), the reshard Job it renders
(render/reshardjob.py), and the status while it goes on and once it ended."""

from __future__ import annotations

import datetime
from typing import Any

from distbelief.operator.cluster import locks, resharding
from distbelief.operator.cluster.locks import RESHARDED_ANNOTATION, RESHARDING_ANNOTATION, SHARDS_ANNOTATION, ShardChange
from distbelief.operator.render import render, reshardjob
from distbelief.operator.render.context import RenderContext
from distbelief.operator.status.status import Observed, compute_status
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob

from support.examples import load_example

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)


def stored(shards: int, *, recorded: int = 2, **annotations: str) -> dict[str, Any]:
    """The digits job as stored with `shards` in its spec, `recorded` in its annotation."""
    doc = spec.validate_job(load_example("digits-mlp.yaml"))
    doc["metadata"].update(uid="u-1", annotations={SHARDS_ANNOTATION: str(recorded), **annotations})
    doc["spec"]["parameterServers"]["shards"] = shards
    return doc


def replicas(job: DistBeliefJob, kind: str) -> int:
    children = render.render_children(job, image="img", held=locks.held_for_reshard(job))
    return next(c["spec"]["replicas"] for c in children if c["kind"] == kind)


def test_a_changed_shard_count_is_followed_with_the_job_held_on_its_recorded_count() -> None:
    locked = locks.locked_job(stored(3))
    assert locked.reshard == ShardChange(recorded=2, target=3) and not locked.refusals
    assert locked.job.config.spec.parameter_servers.shards == 2
    assert locks.held_for_reshard(locked.job)
    assert replicas(locked.job, "StatefulSet") == 0 and replicas(locked.job, "Deployment") == 0


def test_an_unchanged_count_is_neither_followed_nor_held() -> None:
    locked = locks.locked_job(stored(2))
    assert locked.reshard is None and not locks.held_for_reshard(locked.job)
    assert replicas(locked.job, "StatefulSet") == 2


def test_a_count_set_back_during_a_reshard_is_a_reshard_to_it() -> None:
    locked = locks.locked_job(stored(2, **{RESHARDING_ANNOTATION: "3"}))
    assert locked.reshard == ShardChange(recorded=2, target=2)
    assert locks.held_for_reshard(locked.job)


def test_a_sandblaster_job_is_refused_resharding_by_name_and_keeps_running() -> None:
    sandblaster = stored(3)
    sandblaster["spec"]["training"]["algorithm"] = "sandblaster"
    locked = locks.locked_job(sandblaster)
    assert locked.reshard is None and not locks.held_for_reshard(locked.job)
    message = locked.refusals["ShardCountLocked"]
    assert message.startswith("spec.parameterServers.shards changed from 2 to 3: resharding") and "Sandblaster" in message
    assert locked.job.config.spec.parameter_servers.shards == 2


def test_a_job_of_a_kueue_queue_is_resharded_like_any_other() -> None:
    """Its Workload is made anew with the new count (cluster/queue.py, tests/cluster): the
    reshard itself is the same."""
    queued = stored(3)
    queued["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team"}
    locked = locks.locked_job(queued)
    assert locked.reshard == ShardChange(recorded=2, target=3) and not locked.refusals
    assert locks.held_for_reshard(locked.job)


def test_the_reshard_job_mounts_the_claims_of_either_count_and_records_both() -> None:
    job = locks.locked_job(stored(1, recorded=3)).job
    manifest = reshardjob.render_reshard_job(RenderContext.of(job, image="img:1"), 3, 1)
    assert manifest["metadata"]["name"] == "digits-reshard"
    labels = manifest["metadata"]["labels"]
    assert (labels[reshardjob.FROM_LABEL], labels[reshardjob.TO_LABEL]) == ("3", "1")
    assert manifest["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    pod = manifest["spec"]["template"]["spec"]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["checkpoints-digits-ps-0", "checkpoints-digits-ps-1", "checkpoints-digits-ps-2"]
    container = pod["containers"][0]
    assert container["command"] == ["distbelief", "reshard-claims"] and container["image"] == "img:1"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert container["args"][:3] == [mounts["claim-0"], mounts["claim-1"], mounts["claim-2"]]
    assert container["args"][container["args"].index("--shards") + 1] == "1"
    assert pod["restartPolicy"] == "Never" and pod["securityContext"]["runAsNonRoot"]
    claim = reshardjob.render_claim(RenderContext.of(job, image="img:1"), 2)
    assert (claim["kind"], claim["metadata"]["name"]) == ("PersistentVolumeClaim", "checkpoints-digits-ps-2")


def test_the_reshard_pod_asks_what_a_shard_asks_and_is_limited_to_twice_the_old_shards_memory() -> None:
    doc = stored(1, recorded=3)
    doc["spec"]["parameterServers"]["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"},
                                                    "limits": {"cpu": "2", "memory": "2Gi"}}
    ctx = RenderContext.of(locks.locked_job(doc).job, image="img")
    (container,) = reshardjob.render_reshard_job(ctx, 3, 1)["spec"]["template"]["spec"]["containers"]
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"},
                                      "limits": {"memory": str(2 * 3 * 2 ** 31)}}
    del doc["spec"]["parameterServers"]["resources"]["limits"]
    ctx = RenderContext.of(locks.locked_job(doc).job, image="img")
    (container,) = reshardjob.render_reshard_job(ctx, 3, 1)["spec"]["template"]["spec"]["containers"]
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}}


def test_the_job_is_pending_while_it_reshards_and_says_how_the_reshard_ended() -> None:
    job = locks.locked_job(stored(3)).job
    going = compute_status(job, Observed(resharding=("True", "Resharding", "resharding from 2 to 3 shards")), NOW)
    assert going["phase"] == "Pending"
    (condition,) = [c for c in going["conditions"] if c["type"] == "Resharding"]
    assert (condition["status"], condition["message"]) == ("True", "resharding from 2 to 3 shards")
    done = compute_status(job, Observed(shards_ready=2, workers_ready=1,
                                        resharding=("False", "Resharded", "resharded from 2 to 3 shards at step 9")),
                          NOW)
    assert done["phase"] == "Running"
    later = compute_status(DistBeliefJob.of({**job.manifest(), "status": done}), Observed(shards_ready=2, workers_ready=1),
                           NOW)
    (kept,) = [c for c in later["conditions"] if c["type"] == "Resharding"]
    assert (kept["reason"], kept["message"]) == ("Resharded", "resharded from 2 to 3 shards at step 9")
    failed = compute_status(job, Observed(resharding=("False", "ReshardFailed", "the reshard failed")), NOW)
    assert failed["phase"] == "Pending"


def test_a_job_with_shard_copies_is_resharded_over_the_claims_of_every_copy() -> None:
    doc = stored(3)
    doc["spec"]["parameterServers"]["backups"] = 1
    locked = locks.locked_job(doc)
    assert locked.reshard == ShardChange(recorded=2, target=3) and not locked.refusals
    manifest = reshardjob.render_reshard_job(RenderContext.of(locked.job, image="img"), 2, 3)
    volumes = manifest["spec"]["template"]["spec"]["volumes"]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v]
    assert claims == [f"checkpoints-digits-ps-{pod}" for pod in range(6)]   # 3 shards x 2 copies


def test_a_reshard_that_ended_while_no_pass_saw_it_reads_how_it_ended() -> None:
    """The operator killed once the new count was recorded: the next one sees no reshard, and
    reads how it ended from the annotation written with the count."""
    outcome = "resharded from 2 to 3 shards at step 40"
    locked = locks.locked_job(stored(3, recorded=3, **{RESHARDED_ANNOTATION: outcome}))
    assert locked.reshard is None
    job = locked.job
    going = compute_status(job, Observed(resharding=("True", "Resharding", "resharding from 2 to 3 shards")), NOW)
    job_then = DistBeliefJob.of({**job.manifest(), "status": going})
    ended = resharding.ended(job_then)
    assert ended is not None
    after = compute_status(job_then, Observed(resharding=ended.condition()), NOW)
    (condition,) = [c for c in after["conditions"] if c["type"] == "Resharding"]
    assert (condition["status"], condition["reason"], condition["message"]) == ("False", "Resharded", outcome)
