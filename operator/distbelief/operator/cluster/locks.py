"""What a job keeps from its first reconcile, in its annotations: its shard and partition
counts, and the runtime image the operator gave it (an operator upgrade with another
default restarts no running job; its spec.image moves it).

The parameters' places on the shards follow both counts. A changed partition count is
refused. A changed shard count is followed by a reshard (cluster/resharding.py), which
ends by recording the new count; until then the job renders with the recorded one, held
(its pods stopped), and carries RESHARDING_ANNOTATION, which a reshard also records while
its Job runs. A job whose shards cannot be re-laid (Sandblaster) is refused instead. A job
of a Kueue queue is resharded too: its Workload is made anew with the new count
(cluster/queue.py), so it waits suspended, and the reshard runs while it waits."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract, jobspec

SHARDS_ANNOTATION = f"{contract.API_GROUP}/shards"
PARTITIONS_ANNOTATION = f"{contract.API_GROUP}/partitions"
IMAGE_ANNOTATION = f"{contract.API_GROUP}/runtime-image"
# The shard count a reshard is under way to (see above).
RESHARDING_ANNOTATION = f"{contract.API_GROUP}/resharding-to"
# How the last reshard ended (its Job's outcome line), recorded with the count it went to:
# a status pass that reads the job with that count reads the line too.
RESHARDED_ANNOTATION = f"{contract.API_GROUP}/resharded"


@dataclasses.dataclass(frozen=True)
class Lock:
    """A count fixed at the job's creation, kept in an annotation; a change is refused."""

    condition: str       # the status condition and the Warning's reason while a change is refused
    annotation: str
    path: tuple[str, str]  # the count's keys in the spec
    wanted: Callable[[jobspec.JobSpec], int]
    refusal: Callable[[DistBeliefJob], str | None]   # why a change cannot be followed; None: it is


def _reshard_refusal(job: DistBeliefJob) -> str | None:
    spec = job.config.spec
    if spec.training.algorithm == "sandblaster":
        return "resharding a Sandblaster job is not supported"
    return None


LOCKS = (
    Lock("ShardCountLocked", SHARDS_ANNOTATION, ("parameterServers", "shards"),
         lambda spec: spec.parameter_servers.shards, _reshard_refusal),
    Lock("PartitionCountLocked", PARTITIONS_ANNOTATION, ("model", "partitions"), lambda spec: spec.model.partitions,
         lambda _: "repartitioning a job is not supported (the parameters' places on the shards follow the "
                   "partitions)"),
)


@dataclasses.dataclass(frozen=True)
class ShardChange:
    """A reshard to follow: from the recorded count to the spec's."""

    recorded: int
    target: int


@dataclasses.dataclass(frozen=True)
class Locked:
    job: DistBeliefJob                 # with the recorded counts, and held while it reshards
    refusals: dict[str, str]           # a message by condition, for each change refused
    reshard: ShardChange | None = None


def locked_job(validated: dict[str, Any]) -> Locked:
    """The job, parsed, with its shard and partition counts as recorded (in the spec its pods
    read too), a refusal message by condition for each count change refused, and the shard
    change to follow, if any."""
    job, refusals, reshard = DistBeliefJob.of(validated), {}, None
    original = job
    for lock in LOCKS:
        locked, wanted = job.annotations.get(lock.annotation), lock.wanted(job.config.spec)
        if locked is None or int(locked) == wanted:
            continue
        validated = copy.deepcopy(validated)
        validated["spec"].setdefault(lock.path[0], {})[lock.path[1]] = int(locked)
        refusal = lock.refusal(original)
        if refusal is None:
            reshard = ShardChange(int(locked), wanted)
            continue
        field = f"spec.{'.'.join(lock.path)}"
        refusals[lock.condition] = (f"{field} changed from {locked} to {wanted}: {refusal}; the job keeps "
                                    f"{locked} {lock.path[1]} (set it back, or create a new job)")
    if reshard is None and RESHARDING_ANNOTATION in job.annotations:   # the spec went back during a reshard
        reshard = ShardChange(int(job.annotations[SHARDS_ANNOTATION]), job.config.spec.parameter_servers.shards)
    if reshard is None and not refusals:
        return Locked(job, refusals)
    job = DistBeliefJob.of(validated)
    if reshard is not None:
        job = dataclasses.replace(job, annotations={**job.annotations, RESHARDING_ANNOTATION: str(reshard.target)})
    return Locked(job, refusals, reshard)


def held_for_reshard(job: DistBeliefJob) -> bool:
    """Whether the job (as locked_job returns it) is held for a reshard."""
    return RESHARDING_ANNOTATION in job.annotations


def runtime_image(job: DistBeliefJob, default: str) -> str:
    """The image of the job's pods when its spec names none: the one recorded for it, else
    the operator's default (its first reconcile records that)."""
    return job.annotations.get(IMAGE_ANNOTATION) or default
