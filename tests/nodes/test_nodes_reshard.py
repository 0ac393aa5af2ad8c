"""A shard count changed on a job training on the real nodes: the chart's operator
(in-cluster, its RBAC the chart's) stops the pods, a kubelet runs the reshard Job from the
runtime image over the shards' hostPath claims, and the job resumes on the new count at the
step it stopped at, its shards on several nodes."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
import yaml

from support import nodejobs
from support.cluster import Kubectl
from support.kubejobs import restored_steps
from support.paths import EXAMPLES
from support.waiting import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
JOB_SECONDS = 1500   # generous (a shared machine); never asserted on


def reshard_ended(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any] | None:
    return next((c for c in nodejobs.status_of(kubectl, namespace, name).get("conditions", [])
                 if c["type"] == "Resharding" and c["reason"] in ("Resharded", "ReshardFailed")), None)


def test_a_job_training_on_the_nodes_goes_from_2_to_3_shards_and_resumes_at_its_step(
        kubectl: Kubectl, release: str, namespace: str) -> None:
    job = yaml.safe_load((EXAMPLES / "digits-mlp.yaml").read_text())
    name, started = job["metadata"]["name"], time.monotonic()
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(job))
    eventually(lambda: (nodejobs.status_of(kubectl, namespace, name).get("globalStep") or 0) > 500, JOB_SECONDS,
               interval=1, what="training under way")
    kubectl("patch", "dbj", name, "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"parameterServers": {"shards": 3}}}))
    try:
        ended = eventually(lambda: reshard_ended(kubectl, namespace, name), 600, interval=1, what="the reshard ended")
        assert ended["reason"] == "Resharded", ended
        match = re.fullmatch(r"resharded from 2 to 3 shards at step (\d+)", ended["message"])
        assert match and int(match.group(1)) > 500, ended
        for shard in range(3):
            restored = eventually(lambda: restored_steps(kubectl, namespace, f"{name}-ps-{shard}"),  # noqa: B023
                                  300, interval=1, what=f"shard {shard} restored its checkpoint")
            assert restored == [int(match.group(1))], (shard, restored)
    except AssertionError:
        print(nodejobs.diagnostics(kubectl, namespace, release))
        raise
    status, placements = nodejobs.follow(kubectl, namespace, name, timeout=JOB_SECONDS, started=started,
                                         operator_namespace=release)
    assert status["phase"] == "Succeeded" and status["globalStep"] >= job["spec"]["training"]["maxSteps"], status
    shard_nodes = {node for pod, node in placements.items() if re.fullmatch(rf"{name}-ps-\d", pod)}
    assert len(shard_nodes) >= 2, placements
    claims = nodejobs.claims(kubectl, namespace)
    assert sorted(c["metadata"]["name"] for c in claims) == [f"checkpoints-{name}-ps-{i}" for i in range(3)]
    assert {(c["status"]["phase"], c["spec"]["storageClassName"]) for c in claims} == {("Bound", "node-hostpath")}
