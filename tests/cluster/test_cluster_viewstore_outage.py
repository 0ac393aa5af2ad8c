"""Issue 42: the copies' view store out, on a real kube-apiserver 1.36. Two copies of a shard
keep their view in a Lease (kubelease.py) on a control plane of this test's own, while
replicas push; then its API server hangs (SIGSTOP) for a while, and later is killed
(SIGKILL) and started again. The primary cannot renew its lease and no backup can take
over, so no push may be acknowledged once the lease has run out; when the API server is
back the copies go on, whoever leads, and no acknowledged push is lost or applied twice."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from support import controlplane
from support.cluster import unavailable
from support.copyprocesses import LEASE_SECONDS, CopyProcesses, LeaseAt, Pushes, final_verdict
from support.paths import REPO
from support.waiting import eventually

sys.path.insert(0, str(REPO / "benchmarks"))

import copyverdict

OUTAGE_SECONDS = 8.0      # a few leases
REPLY_SLACK_SECONDS = 1.0  # a reply the primary sent just before its lease ran out, still on its way


@pytest.fixture
def own_plane(tmp_path: Path) -> Iterator[controlplane.ControlPlane]:
    """A control plane of this test's own: its API server is the one stopped."""
    folder = controlplane.binaries()
    if folder is None:
        unavailable(f"no Kubernetes control plane here: {controlplane.HOW}")
    plane = controlplane.ControlPlane(folder, tmp_path / "plane").start()
    try:
        yield plane
    finally:
        plane.stop()


def hung(plane: controlplane.ControlPlane) -> dict[str, Any]:
    """The API server frozen: requests to it are taken and never answered."""
    (process,) = [p for name, p in plane.processes if name == "kube-apiserver"]
    began = time.monotonic()
    os.kill(process.pid, signal.SIGSTOP)
    time.sleep(OUTAGE_SECONDS)
    os.kill(process.pid, signal.SIGCONT)
    return {"kind": "hung", "began": began, "ended": time.monotonic()}


def stopped(plane: controlplane.ControlPlane) -> dict[str, Any]:
    """The API server killed, then started again (connections refused meanwhile)."""
    began = time.monotonic()
    plane.stop_component("kube-apiserver")
    time.sleep(OUTAGE_SECONDS)
    ended = time.monotonic()   # it may answer before start_component sees it ready
    plane.start_component("kube-apiserver")
    return {"kind": "stopped", "began": began, "ended": ended}


def acked_during(pushes: Pushes, outage: dict[str, Any]) -> list[int]:
    """Pushes acknowledged once the lease the primary held when the outage began had run out."""
    cutoff = outage["began"] + LEASE_SECONDS + REPLY_SLACK_SECONDS
    return sorted(op.id for op in list(pushes.history) if op.acked and cutoff < op.end < outage["ended"])


@pytest.mark.slow
def test_with_the_api_server_hung_then_stopped_the_copies_acknowledge_nothing_and_then_go_on_losing_nothing(
        own_plane: controlplane.ControlPlane, tmp_path: Path) -> None:
    lease = LeaseAt(own_plane.server, own_plane.admin_token, str(own_plane.dir / "certs" / "apiserver.crt"), "default")
    copies = CopyProcesses(tmp_path, count=2, lease=lease)
    for rank in range(2):
        copies.start(rank)
    eventually(copies.in_sync, 60, what="one copy leads with its backup, their view in the Lease")
    pushes = Pushes(copies, copyverdict.Op).start()
    outages = []
    try:
        eventually(lambda: pushes.acknowledged() >= 50, 30, what="pushes acknowledged")
        for outage in (hung, stopped):
            outages.append(outage(own_plane))
            eventually(lambda ended=outages[-1]["ended"]: pushes.acknowledged(after=ended) >= 20, 60,
                       what=f"pushes acknowledged after the API server {outage.__name__}")
        eventually(copies.in_sync, 60, what="both copies in sync again")
    finally:
        pushes.stop()
    verdict, found = final_verdict(copies, pushes, copyverdict.verdict)
    for outage in outages:
        ends = [op.end for op in pushes.history if op.acked]
        outage.update(last_ack_into=round(max(e for e in ends if e < outage["ended"]) - outage["began"], 2),
                      first_ack_after=round(min(e for e in ends if e > outage["ended"]) - outage["ended"], 2))
    print(outages, found, copies.record())
    for outage in outages:
        late = acked_during(pushes, outage)
        assert not late, (outage, [round(op.end - outage["began"], 2) for op in pushes.history if op.id in late][:40])
        waited = [op.id for op in pushes.history if op.start < outage["ended"] and op.acked and op.end > outage["ended"]]
        assert waited, f"no push was waiting for the copies through the {outage['kind']} API server"
    assert verdict["lost"]["count"] == 0 and verdict["duplicated"]["count"] == 0, found
    assert not verdict["went_back"] and verdict["phantom"]["count"] == 0, found
    assert verdict["steps_match_applied"] == [True], found
