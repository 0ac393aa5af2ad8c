"""A pod's status as a kubelet writes it, from what the agent knows of its containers.

    phase        Pending until a container started; Running while one runs or will be
                 restarted; Succeeded when every container ended with 0 and none will
                 restart, Failed when one of them ended otherwise
    conditions   PodReadyToStartContainers, Initialized, ContainersReady, Ready (beside
                 the scheduler's PodScheduled, kept as it is)
    containerStatuses  state (waiting / running / terminated), lastState, ready, started,
                 restartCount; a terminated state carries exitCode, reason (Completed,
                 Error, OOMKilled, StartError), message, startedAt and finishedAt
    podIP(s), hostIP(s), startTime

A condition's lastTransitionTime changes only when its status does, so the same state
gives the same status and the agent writes only changes.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Mapping, Sequence

Manifest = dict[str, Any]
PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"
OWN_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


def now_text(now: datetime.datetime | None = None) -> str:
    return (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass
class ContainerState:
    """One container as the status shows it."""

    name: str
    image: str
    restarts: int = 0
    pid: int | None = None                 # of the run going on or last ended
    running_since: str | None = None       # set while a run goes on
    waiting: tuple[str, str] | None = ("ContainerCreating", "")
    terminated: Manifest | None = None     # the current state's end (no restart coming)
    last: Manifest | None = None           # lastState.terminated
    ready: bool = False

    @property
    def done(self) -> bool:
        return self.terminated is not None

    def status(self) -> Manifest:
        state: Manifest
        if self.running_since is not None:
            state = {"running": {"startedAt": self.running_since}}
        elif self.terminated is not None:
            state = {"terminated": self.terminated}
        else:
            reason, message = self.waiting or ("ContainerCreating", "")
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        entry: Manifest = {"name": self.name, "image": self.image, "imageID": "", "ready": self.ready,
                           "started": self.running_since is not None, "restartCount": self.restarts,
                           "state": state, "lastState": {"terminated": self.last} if self.last else {}}
        if self.pid is not None:
            entry["containerID"] = f"local-node://{self.pid}"
        return entry


def phase(containers: Sequence[ContainerState], ever_started: bool) -> str:
    if containers and all(c.done for c in containers):
        return SUCCEEDED if all(c.terminated.get("exitCode") == 0 for c in containers) else FAILED
    return RUNNING if ever_started else PENDING


def pod_status(pod: Mapping[str, Any], containers: Sequence[ContainerState], *, ever_started: bool, pod_ip: str,
               host_ip: str, start_time: str, now: str) -> Manifest:
    """The whole status the agent writes (the scheduler's conditions kept)."""
    current = pod.get("status") or {}
    pod_phase = phase(containers, ever_started)
    ready = pod_phase == RUNNING and all(c.ready for c in containers)
    wanted = {"PodReadyToStartContainers": True, "Initialized": True, "ContainersReady": ready, "Ready": ready}
    reasons = {} if ready else {"ContainersReady": "ContainersNotReady", "Ready": "ContainersNotReady"}
    if pod_phase in (SUCCEEDED, FAILED):
        reasons = {"ContainersReady": "PodCompleted", "Ready": "PodCompleted"}
    conditions = [c for c in current.get("conditions") or [] if c.get("type") not in OWN_CONDITIONS]
    for kind, value in wanted.items():
        conditions.append(_condition(current, kind, value, reasons.get(kind), now))
    status: Manifest = {"phase": pod_phase, "conditions": conditions, "hostIP": host_ip, "hostIPs": [{"ip": host_ip}],
                        "podIP": pod_ip, "podIPs": [{"ip": pod_ip}], "startTime": start_time,
                        "containerStatuses": [c.status() for c in containers]}
    if "qosClass" in current:
        status["qosClass"] = current["qosClass"]
    return status


def _condition(current: Mapping[str, Any], kind: str, value: bool, reason: str | None, now: str) -> Manifest:
    state = "True" if value else "False"
    before = next((c for c in current.get("conditions") or [] if c.get("type") == kind), None)
    since = before.get("lastTransitionTime") if before and before.get("status") == state else None
    condition = {"type": kind, "status": state, "lastProbeTime": None, "lastTransitionTime": since or now}
    if reason:
        condition["reason"] = reason
    return condition


def terminated(exit_code: int, *, started: str | None, finished: str, message: str, oom: bool,
               pid: int | None) -> Manifest:
    """A run's end as state.terminated shows it."""
    reason = "OOMKilled" if oom else "Completed" if exit_code == 0 else "Error"
    end: Manifest = {"exitCode": exit_code, "reason": reason, "startedAt": started or finished, "finishedAt": finished}
    if message:
        end["message"] = message
    if pid is not None:
        end["containerID"] = f"local-node://{pid}"
    return end
