"""pytest fixtures of a node agent on the cluster tier's control plane, and the operator beside it.

    local_node    tools/local-node running against the session's control plane (module-scoped):
                  a Ready Node that runs the pods bound to it as processes
    chart         the chart installed (the CRD), its operator Deployment scaled to 0
    operator      `distbelief operator` as a local process watching the test's namespace, with
                  the admin kubeconfig, reading the chief's metrics through the node's endpoint

They need what support/cluster.py needs, and skip or fail (CI=true) the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from support import controlplane
from support.cluster import Kubectl, stop_process, unavailable
from support.paths import REPO
from support.waiting import eventually

# The test node offers more CPUs than a small CI machine has, so that the examples' CPU
# requests fit it: the scheduler packs by requests, the processes share what there is.
NODE_CPUS = "16"
METRICS_URL = "http://127.0.0.1:{port}/api/v1/namespaces/{{namespace}}/pods/{{pod}}:{{port}}/proxy/metrics"


@dataclasses.dataclass
class LocalNode:
    name: str
    root: Path
    port: int
    process: subprocess.Popen
    log_path: Path

    def log(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def pod_lines(self, namespace: str, *words: str, lines: int = 60) -> str:
        """The last lines holding any of words of the logs of the namespace's pods here
        (kept under root/logs, pods gone too), each after its pod's name."""
        found = [f"{folder.name.split('_')[1]}: {line}"
                 for folder in sorted((self.root / "logs").glob(f"{namespace}_*"))
                 for path in sorted(folder.glob("*.log"))
                 for line in path.read_text(errors="replace").splitlines() if any(word in line for word in words)]
        return "\n".join(found[-lines:])


def _exited_early(process: subprocess.Popen, log_path: Path) -> None:
    if process.poll() is not None:
        raise AssertionError(f"local-node exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def local_node(control_plane: controlplane.ControlPlane, kubectl: Kubectl,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    if not control_plane.has("kube-scheduler") or not control_plane.has("kube-controller-manager"):
        unavailable("the node agent's tests need kube-scheduler and kube-controller-manager beside the API server")
    name = f"node-{uuid.uuid4().hex[:6]}"
    root = tmp_path_factory.mktemp("local-node")
    log_path = root.parent / f"{name}.log"
    command = [str(REPO / "tools" / "local-node"), "--kubeconfig", str(control_plane.kubeconfig), "--name", name,
               "--root", str(root), "--cpu", NODE_CPUS, "--heartbeat", "2"]
    with open(log_path, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHON": sys.executable}, start_new_session=True)

    def ready() -> int | None:
        _exited_early(process, log_path)
        done = kubectl.run("get", "node", name, "-o", "json")
        if done.returncode != 0:
            return None
        node = json.loads(done.stdout)
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))
        tainted = any(t["key"].startswith("node.kubernetes.io/not-ready") for t in node["spec"].get("taints") or [])
        return node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"] if ready and not tainted else None

    try:
        port = eventually(ready, 60, what=f"Node {name} Ready and untainted")
        yield LocalNode(name=name, root=root, port=port, process=process, log_path=log_path)
    finally:
        stop_process(process)
        kubectl("delete", "node", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def chart(helm: Callable[..., str], kubectl: Kubectl) -> str:
    """The chart as a release of its own (its crds/ folder brings the CRD when absent), with
    no operator pod: the tests run the operator as a process."""
    helm("upgrade", "--install", "distbelief-node", str(REPO / "charts" / "distbelief"), "--namespace",
         "distbelief-node", "--create-namespace", "--set", "operator.replicas=0", "--set", "peering.enabled=false")
    kubectl("wait", "--for=condition=Established", "crd/distbeliefjobs.distbelief.io", "--timeout=60s")
    return "distbelief-node"


@pytest.fixture
def operator(chart: str, control_plane: controlplane.ControlPlane, local_node: LocalNode, namespace: str,
             tmp_path: Path) -> Iterator[Path]:
    """The operator watching the test's namespace; yields the path of its log."""
    log_path = tmp_path / "operator.log"
    env = control_plane.env(DISTBELIEF_METRICS_URL=METRICS_URL.format(port=local_node.port),
                            DISTBELIEF_STATUS_INTERVAL="1")
    with open(log_path, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "distbelief.operator.cli", "operator", "--namespace",
                                    namespace, "--standalone", "--liveness", ""], stdout=out,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield log_path
    finally:
        stop_process(process)


def get(kubectl: Kubectl, *args: str) -> Any:
    """kubectl get ... -o json, None when absent."""
    done = kubectl.run("get", *args, "-o", "json")
    return json.loads(done.stdout) if done.returncode == 0 else None


def apply(kubectl: Kubectl, namespace: str, *docs: dict[str, Any]) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))


def example(name: str, **changes: Any) -> dict[str, Any]:
    """An example job made small: fewer steps and replicas, runs in seconds."""
    doc = yaml.safe_load((REPO / "examples" / name).read_text())
    job = copy.deepcopy(doc)
    job["spec"]["training"].update(maxSteps=2000, maxDuration="2m")
    job["spec"]["workers"]["replicas"] = 2
    for path, value in changes.items():
        node = job["spec"]
        *parents, leaf = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return job


def job_status(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    return (get(kubectl, "dbj", name, "-n", namespace) or {}).get("status") or {}


def finished(kubectl: Kubectl, namespace: str, name: str, operator_log: Path, since: float) -> dict[str, Any]:
    """The job's status once Succeeded or Failed (the operator's log shown if it never is)."""
    try:
        status = eventually(lambda: (s := job_status(kubectl, namespace, name)).get("phase") in ("Succeeded", "Failed")
                            and s, 120, interval=0.5, what=f"{name} finished")
    except AssertionError:
        print(operator_log.read_text()[-3000:])
        raise
    print(f"{name}: {status['phase']} {time.monotonic() - since:.1f} s after kubectl apply")
    return status
