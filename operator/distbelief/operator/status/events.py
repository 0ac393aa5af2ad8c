"""The Events of a job's shards: one on every shard restart and on every failover.

Pure functions: what the operator saw at its last status pass and what it sees now in,
(reason, message) Warnings out. A shard container's restart shows as its pod's
restartCount going up (a crash, an OOM kill, a failed liveness probe); a failover as a
shard's failovers (status.shards, from the chief) going up, with the pod that took over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from distbelief.operator.status.status import how_it_ended
from distbelief.runtime import contract

Event = tuple[str, str]


def shard_restarts(pods: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, str]]:
    """Each shard pod's container restarts, and how its container last ended."""
    seen = {}
    for pod in pods:
        if (pod["metadata"].get("labels") or {}).get(contract.LABEL_ROLE) != contract.ROLE_PS:
            continue
        name = pod["metadata"]["name"]
        for container in (pod.get("status") or {}).get("containerStatuses", []):
            last = (container.get("lastState") or {}).get("terminated") or {}
            how = how_it_ended(name, last) if "exitCode" in last else f"{name} restarted"
            seen[name] = (int(container.get("restartCount", 0)), how)
    return seen


def restart_events(before: Mapping[str, int] | None, now: Mapping[str, tuple[int, str]]) -> list[Event]:
    """A ShardRestarted Event for every shard pod whose restarts went up since the last
    pass; none at the first pass (before is None: no count to compare with yet)."""
    if before is None:
        return []
    return [("ShardRestarted", f"{how} (restart {count})") for pod, (count, how) in sorted(now.items())
            if count > before.get(pod, count)]


def failover_events(before: Mapping[str, Any] | None, now: Mapping[str, Any] | None) -> list[Event]:
    """A ShardFailover Event for every shard whose failovers went up (status.shards)."""
    events = []
    for shard, seen in sorted((now or {}).items()):
        was = (before or {}).get(shard)
        if was and int(seen.get("failovers", 0)) > int(was.get("failovers", 0)):
            events.append(("ShardFailover", f"shard {shard}: {seen.get('primary')} took over from "
                                            f"{was.get('primary')} (failover {seen['failovers']} since the job started)"))
    return events
