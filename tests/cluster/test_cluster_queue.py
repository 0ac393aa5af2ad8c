"""Kueue's contract on a real control plane, the test playing Kueue: a job labelled with a
queue waits suspended, starts where its admission places it, is suspended by an eviction
and resumes from its checkpoints when admitted again (tools/local-node runs the pods)."""

from __future__ import annotations

import json
import re
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from support import kueue
from support.cluster import Kubectl
from support.kubejobs import restored_steps
from support.localnode import (LocalNode, apply, chart, example, finished, get, job_status,  # noqa: F401 (fixtures)
                               local_node, operator)
from support.waiting import eventually

TAINT = "example.com/spot"
MAX_STEPS = 40_000


@pytest.fixture
def spot_flavor(kubectl: Kubectl, local_node: LocalNode) -> Any:
    """The Kueue types, and a ResourceFlavor whose node label and toleration are the node's
    own (the node tainted for it): a pod lands there only with what the admission injects."""
    kueue.install_crds(kubectl)
    pool = f"spot-{uuid.uuid4().hex[:6]}"
    kubectl("taint", "node", local_node.name, f"{TAINT}=true:NoSchedule")
    kubectl("label", "node", local_node.name, f"example.com/pool={pool}")
    kueue.flavor(kubectl, pool, {"example.com/pool": pool}, [{"key": TAINT, "operator": "Exists",
                                                              "effect": "NoSchedule"}])
    try:
        yield pool
    finally:
        kubectl("taint", "node", local_node.name, f"{TAINT}-", check=False)
        kubectl("label", "node", local_node.name, "example.com/pool-", check=False)


def pods(kubectl: Kubectl, namespace: str) -> list[dict[str, Any]]:
    return get(kubectl, "pods", "-n", namespace, "-l", "distbelief.io/job=digits")["items"]


def phase_reason(kubectl: Kubectl, namespace: str) -> tuple[str | None, str | None]:
    status = job_status(kubectl, namespace, "digits")
    condition = next((c for c in status.get("conditions") or [] if c["type"] == status.get("phase")), {})
    return status.get("phase"), condition.get("reason")


@pytest.mark.slow
def test_a_queued_job_waits_runs_where_admitted_survives_eviction_and_resumes(
        kubectl: Kubectl, local_node: LocalNode, namespace: str, operator: Path, spot_flavor: str) -> None:
    # Long enough that the eviction below comes mid-training on a fast machine (about 2,000
    # steps/s on 2 cores), short enough to finish within the wait once resumed.
    job = example("digits-mlp.yaml", training__maxSteps=MAX_STEPS, training__maxDuration="5m",
                  parameterServers__checkpoint__everySeconds=1)
    job["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-a"}
    apply(kubectl, namespace, job)
    name = "distbeliefjob-digits"

    # Queued: suspended, its Workload asks for every pod of the job, nothing runs.
    created = eventually(lambda: kueue.workload(kubectl, namespace, name), 30, what="the Workload")
    assert created["spec"]["queueName"] == "team-a"
    assert {s["name"]: s["count"] for s in created["spec"]["podSets"]} == {"ps": 2, "worker": 2}
    assert created["metadata"]["ownerReferences"][0]["kind"] == "DistBeliefJob"
    eventually(lambda: phase_reason(kubectl, namespace) == ("Suspended", "Queued"), 30, what="Suspended, Queued")
    assert get(kubectl, "dbj", "digits", "-n", namespace)["spec"]["runPolicy"]["suspend"] is True
    assert not pods(kubectl, namespace)
    # Unsuspended by hand, with an admission annotation of its own making: held all the same.
    generation = get(kubectl, "statefulset", "digits-ps", "-n", namespace)["metadata"]["generation"]
    kubectl("patch", "dbj", "digits", "-n", namespace, "--type=merge", "-p", json.dumps(
        {"metadata": {"annotations": {"distbelief.io/admission": "{}"}}, "spec": {"runPolicy": {"suspend": False}}}))
    eventually(lambda: (held := get(kubectl, "dbj", "digits", "-n", namespace))["spec"]["runPolicy"]["suspend"]
               and "distbelief.io/admission" not in held["metadata"].get("annotations", {}), 30, what="held again")
    statefulset = get(kubectl, "statefulset", "digits-ps", "-n", namespace)
    assert (statefulset["spec"]["replicas"], statefulset["metadata"]["generation"]) == (0, generation)

    # Admitted: the pods start with the flavor's node selector and toleration, on the tainted node.
    kueue.admit(kubectl, namespace, name, spot_flavor)
    running = eventually(lambda: (found := pods(kubectl, namespace)) and len(found) == 4
                         and all(p["spec"].get("nodeName") for p in found) and found, 60, what="pods bound")
    for pod in running:
        assert pod["spec"]["nodeSelector"]["example.com/pool"] == spot_flavor
        assert any(t["key"] == TAINT for t in pod["spec"]["tolerations"])
    eventually(lambda: (job_status(kubectl, namespace, "digits").get("lastCheckpoint") or {}).get("step"),
               90, what="a checkpoint")
    # kubectl get shows how far the job is and when it will be done.
    eventually(lambda: job_status(kubectl, namespace, "digits").get("eta"), 30, interval=0.3, what="an ETA")
    header, row = kubectl("get", "dbj", "digits", "-n", namespace).splitlines()
    columns = dict(zip(header.split(), row.split()))
    assert 0 < float(columns["PROGRESS"]) < 100 and columns["ETA"][-1] in "smhd", (header, row)

    # Evicted: suspended, no pods, the admission given back to Kueue.
    kueue.evict(kubectl, namespace, name)
    eventually(lambda: phase_reason(kubectl, namespace) == ("Suspended", "Evicted"), 30, what="Suspended, Evicted")
    eventually(lambda: not pods(kubectl, namespace), 60, what="the pods gone")
    checkpoint = job_status(kubectl, namespace, "digits")["lastCheckpoint"]["step"]  # the last before the eviction
    given_back = eventually(lambda: (w := kueue.workload(kubectl, namespace, name))
                            and kueue.condition(w, "QuotaReserved").get("status") == "False" and w, 30)
    assert given_back["status"].get("admission") is None

    # Admitted again: training goes on from the checkpoints, its step never going back.
    kueue.admit(kubectl, namespace, name, spot_flavor)
    steps: list[int] = []

    def sampled() -> dict[str, Any]:
        status = job_status(kubectl, namespace, "digits")
        steps.append(int(status.get("globalStep") or 0))
        return status

    eventually(lambda: sampled().get("phase") in ("Succeeded", "Failed"), 180, interval=0.5,
               what="the resumed job finished")
    status = job_status(kubectl, namespace, "digits")
    assert status["phase"] == "Succeeded", json.dumps(status)
    print(f"checkpoint at step {checkpoint} before the eviction; lowest step after it {min(steps)}, "
          f"final {status['globalStep']}")
    assert min(steps) >= checkpoint, (checkpoint, steps[:20])
    assert status["globalStep"] >= MAX_STEPS and status["progress"] == 100 and "eta" not in status
    finished = eventually(lambda: kueue.condition(kueue.workload(kubectl, namespace, name), "Finished")
                          .get("status") == "True", 30, what="the Workload Finished")
    assert finished


@pytest.mark.slow
def test_a_queued_job_resharded_waits_for_an_admission_of_the_new_count_and_resumes_at_its_step(
        kubectl: Kubectl, local_node: LocalNode, namespace: str, operator: Path) -> None:
    """spec.parameterServers.shards changed on a running job of a queue: its Workload is made
    anew asking for 3 shards and the job waits suspended, the reshard Job re-laying its claims
    meanwhile; once Kueue admits the new Workload, each of the 3 shards restores the re-laid
    checkpoint at the reshard's step, and the job trains to Succeeded."""
    kueue.install_crds(kubectl)
    pool = f"plain-{uuid.uuid4().hex[:6]}"
    kueue.flavor(kubectl, pool, {}, [])
    job = example("digits-mlp.yaml", training__maxSteps=4000, training__maxDuration="5m")
    job["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-a"}
    apply(kubectl, namespace, job)
    workload, since = "distbeliefjob-digits", time.monotonic()
    eventually(lambda: kueue.workload(kubectl, namespace, workload), 30, what="the Workload")
    kueue.admit(kubectl, namespace, workload, pool)
    eventually(lambda: (job_status(kubectl, namespace, "digits").get("globalStep") or 0) > 500, 90, interval=0.3,
               what="training under way")
    kubectl("patch", "dbj", "digits", "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"parameterServers": {"shards": 3}}}))

    requeued = eventually(lambda: (w := kueue.workload(kubectl, namespace, workload))
                          and {s["name"]: s["count"] for s in w["spec"]["podSets"]} == {"ps": 3, "worker": 2} and w,
                          60, what="the Workload made anew for 3 shards")
    assert not (requeued.get("status") or {}).get("admission"), requeued
    # Made anew as the reshard starts, not once it ends: no pod runs on the old admission.
    under_way = {c["type"]: c["reason"] for c in job_status(kubectl, namespace, "digits").get("conditions", [])}
    assert under_way.get("Resharding") not in ("Resharded", "ReshardFailed"), under_way
    ended = eventually(lambda: next((c for c in job_status(kubectl, namespace, "digits").get("conditions", [])
                                     if c["type"] == "Resharding" and c["reason"] in ("Resharded", "ReshardFailed")),
                                    None), 180, interval=0.5, what="the reshard ended")
    match = re.fullmatch(r"resharded from 2 to 3 shards at step (\d+)", ended["message"])
    assert match and int(match.group(1)) > 500, ended
    eventually(lambda: phase_reason(kubectl, namespace) == ("Suspended", "Queued"), 30, what="Suspended, Queued")
    running = [p["metadata"]["name"] for p in pods(kubectl, namespace) if p["status"].get("phase") == "Running"]
    assert not running, running

    kueue.admit(kubectl, namespace, workload, pool)
    for shard in range(3):
        restored = eventually(partial(restored_steps, kubectl, namespace, f"digits-ps-{shard}"), 60, interval=0.5,
                              what=f"shard {shard} restored its checkpoint")
        assert restored == [int(match.group(1))], (shard, restored)
    status = finished(kubectl, namespace, "digits", operator, since)
    assert status["phase"] == "Succeeded" and status["globalStep"] >= 4000, status
    assert len(get(kubectl, "pvc", "-n", namespace)["items"]) == 3
