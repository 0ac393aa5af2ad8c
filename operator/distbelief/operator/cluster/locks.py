"""What a job keeps from its first reconcile, in its annotations: its shard and partition
counts (a change is refused: the parameters' places on the shards follow them) and the
runtime image the operator gave it (an operator upgrade with another default restarts no
running job; its spec.image moves it)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract, jobspec

SHARDS_ANNOTATION = f"{contract.API_GROUP}/shards"
PARTITIONS_ANNOTATION = f"{contract.API_GROUP}/partitions"
IMAGE_ANNOTATION = f"{contract.API_GROUP}/runtime-image"


@dataclasses.dataclass(frozen=True)
class Lock:
    """A count fixed at the job's creation, kept in an annotation; a change is refused."""

    condition: str       # the status condition and the Warning's reason while a change is refused
    annotation: str
    path: tuple[str, str]  # the count's keys in the spec
    wanted: Callable[[jobspec.JobSpec], int]
    refusal: str         # why the change cannot be followed


LOCKS = (
    Lock("ShardCountLocked", SHARDS_ANNOTATION, ("parameterServers", "shards"),
         lambda spec: spec.parameter_servers.shards, "resharding a job is not supported"),
    Lock("PartitionCountLocked", PARTITIONS_ANNOTATION, ("model", "partitions"), lambda spec: spec.model.partitions,
         "repartitioning a job is not supported (the parameters' places on the shards follow the partitions)"),
)


def locked_job(validated: dict[str, Any]) -> tuple[DistBeliefJob, dict[str, str]]:
    """The job, parsed, with its shard and partition counts as created (in the spec its pods
    read too), and a refusal message by condition for each count the spec changed."""
    job, refusals = DistBeliefJob.of(validated), {}
    for lock in LOCKS:
        locked, wanted = job.annotations.get(lock.annotation), lock.wanted(job.config.spec)
        if locked is None or int(locked) == wanted:
            continue
        validated = copy.deepcopy(validated)
        validated["spec"].setdefault(lock.path[0], {})[lock.path[1]] = int(locked)
        field = f"spec.{'.'.join(lock.path)}"
        refusals[lock.condition] = (f"{field} changed from {locked} to {wanted}: {lock.refusal}; the job keeps "
                                    f"{locked} {lock.path[1]} (set it back, or create a new job)")
    return (DistBeliefJob.of(validated) if refusals else job), refusals


def runtime_image(job: DistBeliefJob, default: str) -> str:
    """The image of the job's pods when its spec names none: the one recorded for it, else
    the operator's default (its first reconcile records that)."""
    return job.annotations.get(IMAGE_ANNOTATION) or default
