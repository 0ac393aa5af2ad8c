"""`helm upgrade` to a new operator image while a job trains, on real nodes: the operator's
pod is replaced (the chart's Recreate strategy), the new operator takes the job over, and
nothing of the job is recreated or changed: its children keep their uids and generations,
its pods their uids and restart counts, its pods their runtime image (the new release's
default runtime image is another), and it trains on to Succeeded.

Runs last in the session (its file name): it leaves the release upgraded.
"""

from __future__ import annotations

import copy
import subprocess
import time
from typing import Any, Callable

import pytest
import yaml

from support import nodejobs, nodes
from support.cluster import CHART, RELEASE, Kubectl
from support.nodes import NodeCluster
from support.paths import EXAMPLES
from support.waiting import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
NAME = "upgrade"
NEXT_TAG = "0.1.0-next"
# Long enough (two minutes on the nodes) to be still training once the new operator has it.
STEPS = 60_000
CHILD_KINDS = "configmaps,services,statefulsets,deployments,poddisruptionbudgets,networkpolicies"


def next_image(ref: str) -> str:
    """ref tagged NEXT_TAG in docker: a new release of the same image."""
    new = f"{ref.rsplit(':', 1)[0]}:{NEXT_TAG}"
    subprocess.run(["docker", "tag", ref, new], check=True, capture_output=True, timeout=120)
    return new


def job_objects(kubectl: Kubectl, namespace: str) -> dict[str, tuple[str, int | None]]:
    """Every child and pod of the job: kind/name -> (uid, generation or restart count)."""
    found = {}
    for obj in kubectl.json("get", CHILD_KINDS, "-n", namespace, "-l", f"distbelief.io/job={NAME}")["items"]:
        found[f"{obj['kind']}/{obj['metadata']['name']}"] = (obj["metadata"]["uid"], obj["metadata"].get("generation"))
    for pod in nodejobs.job_pods(kubectl, namespace, NAME):
        restarts = sum(c.get("restartCount", 0) for c in pod.get("status", {}).get("containerStatuses") or [])
        found[f"Pod/{pod['metadata']['name']}"] = (pod["metadata"]["uid"], restarts)
    return found


def operator_pod(kubectl: Kubectl, release: str) -> dict[str, Any]:
    pods = [p for p in kubectl.json("get", "pods", "-n", release, "-l", "app.kubernetes.io/name=distbelief")["items"]
            if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]


def test_helm_upgrade_to_a_new_operator_image_while_a_job_trains_recreates_nothing(
        kubectl: Kubectl, release: str, namespace: str, node_cluster: NodeCluster,
        helm: Callable[..., str]) -> None:
    doc = copy.deepcopy(yaml.safe_load((EXAMPLES / "digits-mlp.yaml").read_text()))
    doc["metadata"]["name"] = NAME
    doc["spec"]["training"].update(maxSteps=STEPS, maxDuration="30m")
    started = time.monotonic()
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    eventually(lambda: nodejobs.status_of(kubectl, namespace, NAME).get("globalStep", 0) > 0, 600, interval=2,
               what="the job training")
    before = job_objects(kubectl, namespace)
    old_pod = operator_pod(kubectl, release)
    images = {c["image"] for p in nodejobs.job_pods(kubectl, namespace, NAME) for c in p["spec"]["containers"]}
    assert images == {nodes.RUNTIME_IMAGE}, images

    with nodes.Timed("upgrade: the next operator and runtime images loaded"):
        node_cluster.load_images([next_image(nodes.OPERATOR_IMAGE), next_image(nodes.RUNTIME_IMAGE)])
    with nodes.Timed("upgrade: helm upgrade --wait"):
        helm("upgrade", RELEASE, str(CHART), "--namespace", release, "--reuse-values", "--set",
             f"image.tag={NEXT_TAG}", "--wait", "--timeout", "10m", timeout=660)
    new_pod = operator_pod(kubectl, release)
    assert new_pod["metadata"]["uid"] != old_pod["metadata"]["uid"]
    assert new_pod["spec"]["containers"][0]["image"].endswith(f":{NEXT_TAG}")
    # The new operator has the job: its status moves on.
    step = nodejobs.status_of(kubectl, namespace, NAME).get("globalStep", 0)
    status = eventually(lambda: (s := nodejobs.status_of(kubectl, namespace, NAME)).get("globalStep", 0) > step
                        and s, 300, interval=2, what="the new operator's status of the job")
    assert status["phase"] == "Running", status   # nothing recreated, nothing restarted:
    assert job_objects(kubectl, namespace) == before
    status, _ = nodejobs.follow(kubectl, namespace, NAME, timeout=1500, started=started, operator_namespace=release)
    assert status["globalStep"] >= STEPS, status
    images = {c["image"] for p in nodejobs.job_pods(kubectl, namespace, NAME) for c in p["spec"]["containers"]}
    assert images <= {nodes.RUNTIME_IMAGE}, images   # the job kept the image it was made with
