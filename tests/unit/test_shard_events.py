"""The Events of a job's shards: one on every shard restart and on every failover (a pure function)."""

from __future__ import annotations

from typing import Any

from distbelief.operator.status import events


def shard_pod(name: str, restarts: int, last: dict[str, Any] | None = None, role: str = "ps") -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"distbelief.io/role": role}},
            "status": {"containerStatuses": [{"restartCount": restarts,
                                              "lastState": {"terminated": last} if last else {}}]}}


def test_every_shard_restart_since_the_last_pass_is_an_event_saying_how_it_ended() -> None:
    pods = [shard_pod("d-ps-0", 2, {"exitCode": 137, "reason": "OOMKilled"}), shard_pod("d-ps-1", 0),
            shard_pod("d-worker-x", 5, {"exitCode": 1}, role="worker")]
    now = events.shard_restarts(pods)
    assert set(now) == {"d-ps-0", "d-ps-1"}                  # shards only
    (event,) = events.restart_events({"d-ps-0": 1, "d-ps-1": 0}, now)
    assert event[0] == "ShardRestarted"
    assert event[1].startswith("d-ps-0 last exited with code 137 (OOMKilled") and event[1].endswith("(restart 2)")
    assert events.restart_events({"d-ps-0": 2, "d-ps-1": 0}, now) == []   # nothing new
    assert events.restart_events(None, now) == []            # first pass: no baseline
    assert events.restart_events({}, now) == []              # pods not seen before: recreated, not restarted


def test_every_failover_is_an_event_naming_the_pod_that_took_over() -> None:
    before = {"0": {"copies": 2, "primary": "d-ps-0", "failovers": 0}, "1": {"copies": 2, "primary": "d-ps-1",
                                                                           "failovers": 1}}
    after = {"0": {"copies": 1, "primary": "d-ps-2", "failovers": 1}, "1": before["1"]}
    assert events.failover_events(before, after) == [
        ("ShardFailover", "shard 0: d-ps-2 took over from d-ps-0 (failover 1 since the job started)")]
    assert events.failover_events(after, after) == [] and events.failover_events(None, after) == []
