"""A job's pods as the plugin shows and picks them, from a cluster or a local run alike.

A shard pod's ordinal (the StatefulSet's) is its shard, ordinal % shards, and its copy,
ordinal // shards; the chief runs in the pod of shard 0's first copy (ordinal 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from distbelief.runtime import contract

CHIEF = "chief"
ROLES = (contract.ROLE_PS, contract.ROLE_WORKER, CHIEF)


@dataclasses.dataclass(frozen=True)
class Pod:
    name: str
    role: str          # contract.ROLE_PS or contract.ROLE_WORKER
    ready: bool
    restarts: int = 0
    phase: str = ""    # the pod's phase on a cluster; Running or Exited locally


def from_manifest(pod: Mapping[str, Any]) -> Pod:
    """A cluster's pod, by its labels and status."""
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    return Pod(name=pod["metadata"]["name"], role=(pod["metadata"].get("labels") or {}).get(contract.LABEL_ROLE, ""),
               ready=bool(containers) and all(c.get("ready") for c in containers),
               restarts=sum(int(c.get("restartCount", 0)) for c in containers), phase=status.get("phase", ""))


def ordinal(job: str, pod: str) -> int | None:
    """A shard pod's StatefulSet ordinal; None for another pod."""
    prefix = contract.JobNames(job).ps + "-"
    tail = pod[len(prefix):] if pod.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def shard_of(config: contract.JobConfig, pod: Pod) -> tuple[int, int] | None:
    """(shard, copy rank) of a shard pod; None for a replica."""
    found = ordinal(config.name, pod.name) if pod.role == contract.ROLE_PS else None
    return None if found is None else config.copy_of(found)


def select(config: contract.JobConfig, pods: list[Pod], *, role: str | None, shard: int | None) -> list[Pod]:
    """The pods of role (ps, worker, or chief: shard 0's first copy), of parameter shard
    `shard` when given (every copy of it); ValueError naming what does not fit the job."""
    shards = config.spec.parameter_servers.shards
    if shard is not None and role not in (None, contract.ROLE_PS):
        raise ValueError(f"--shard picks a parameter shard's pods: it goes with --role {contract.ROLE_PS}, "
                         f"not --role {role}")
    if shard is not None and not 0 <= shard < shards:
        raise ValueError(f"--shard {shard}: job {config.name} has shards 0 to {shards - 1}")
    if role == CHIEF:
        return [pod for pod in pods if shard_of(config, pod) == (0, 0)]
    if shard is not None:
        return [pod for pod in pods if (shard_of(config, pod) or (None,))[0] == shard]
    return [pod for pod in pods if role in (None, pod.role)]


def sort_key(config: contract.JobConfig, pod: Pod) -> tuple[int, int, str]:
    """Shards first, by ordinal; then the replicas by name."""
    found = ordinal(config.name, pod.name) if pod.role == contract.ROLE_PS else None
    return (0, found, "") if found is not None else (1, 0, pod.name)
