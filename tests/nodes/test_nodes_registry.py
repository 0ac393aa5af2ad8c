"""The runtime image from a private registry (support/registry.py: TLS, htpasswd), as
docs/install.md tells a user to run it: `spec.image` names the image in the registry and
`spec.imagePullSecrets` the Secret with its credentials. Without the Secret the nodes'
containerd is refused and the pods wait in ImagePullBackOff; with it they pull and the
job trains to Succeeded."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from support import nodejobs
from support.cluster import Kubectl
from support.nodes import NodeCluster
from support.paths import EXAMPLES
from support.waiting import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
JOB_SECONDS = 1500      # generous (a shared machine); never asserted on
SECRET = "registry-credentials"
REFUSED = ("ErrImagePull", "ImagePullBackOff")


def private_job(name: str, image: str, secret: str | None) -> dict[str, Any]:
    job = yaml.safe_load((EXAMPLES / "digits-mlp.yaml").read_text())
    job["metadata"]["name"] = name
    job["spec"]["image"] = image
    if secret:
        job["spec"]["imagePullSecrets"] = [{"name": secret}]
    return job


def pull_refusals(kubectl: Kubectl, namespace: str, job: str) -> list[str]:
    """The messages of the job's containers waiting because their image pull failed."""
    return [waiting.get("message", "") for pod in nodejobs.job_pods(kubectl, namespace, job)
            for status in (pod.get("status") or {}).get("containerStatuses", [])
            if (waiting := status.get("state", {}).get("waiting", {})).get("reason") in REFUSED]


def test_a_job_pulls_its_image_from_a_private_registry_with_its_pull_secret_and_not_without(
        node_cluster: NodeCluster, kubectl: Kubectl, release: str, namespace: str) -> None:
    image = node_cluster.registry_image
    assert node_cluster.registry and image.startswith(node_cluster.registry.address + "/"), image

    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(private_job("no-secret", image, None)))
    refusals = eventually(lambda: pull_refusals(kubectl, namespace, "no-secret"), 300, 1,
                          "a pod of the job without a pull secret refused its image")
    assert any("401 Unauthorized" in m or "authorization failed" in m or "no basic auth credentials" in m
               for m in refusals), refusals
    assert nodejobs.status_of(kubectl, namespace, "no-secret").get("phase") != "Succeeded"
    kubectl("delete", "dbj", "-n", namespace, "no-secret", "--wait=true", timeout=300)

    kubectl("create", "secret", "generic", SECRET, "-n", namespace, "--type=kubernetes.io/dockerconfigjson",
            f"--from-literal=.dockerconfigjson={node_cluster.registry.docker_config_json()}")
    job = private_job("private", image, SECRET)
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(job))
    pods = eventually(lambda: running_pods(kubectl, namespace, "private"), 600, 1, "the job's pods running")
    assert all(c["image"] == image for p in pods for c in p["spec"]["containers"]), pods
    assert all({"name": SECRET} in p["spec"].get("imagePullSecrets", []) for p in pods), pods
    # Each container runs the image pulled from the registry (named by its digest there).
    image_ids = {s["imageID"] for p in pods for s in p["status"]["containerStatuses"]}
    assert all(i.startswith(image.rsplit(":", 1)[0] + "@sha256:") for i in image_ids), image_ids
    status, placements = nodejobs.follow(kubectl, namespace, "private", timeout=JOB_SECONDS,
                                         operator_namespace=release)
    nodejobs.assert_learned(kubectl, namespace, "private", status, "accuracy", 0.9, release)
    assert len(set(placements.values())) >= 2, placements


def running_pods(kubectl: Kubectl, namespace: str, job: str) -> list[dict[str, Any]] | None:
    """The job's pods once its shards and replicas all run (digits: 2 and 3)."""
    pods = nodejobs.job_pods(kubectl, namespace, job)
    running = [p for p in pods if all(s.get("state", {}).get("running")
                                      for s in (p.get("status") or {}).get("containerStatuses", [{}]))]
    return running if len(running) == 5 else None
