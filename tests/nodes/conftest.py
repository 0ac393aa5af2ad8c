"""The nodes tier: the product on real nodes (issue 38). One cluster per session
(support/nodes.py): a control plane, three real nodes (one in this machine's network
namespace, two in their own, one of those links shaped to 1gbit), CoreDNS, hostPath
volumes, the images of `make image` in every node, and the chart installed by helm with its
operator running as the chart's Deployment, in-cluster. The tests apply DistBeliefJobs as a
user does.

    node_cluster    the session's NodeCluster (started, stopped at the end)
    control_plane   the same object, for support/cluster.py's kubectl, api, helm and namespace
    release         the chart installed (--wait: the operator pod Ready): its namespace

Needs root and ../shared/kube beside the repository: the tier skips without them (one line
saying why), and fails instead under CI=true. `sudo make test-nodes` runs it.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Callable, Iterator

import pytest

from support import controlplane, nodes
from support.cluster import CHART, CRD_NAME, RELEASE, RELEASE_NAMESPACE, Kubectl, unavailable

# The chart's own defaults name the images `make image` tags (distbelief/operator for the
# operator, distbelief/distbelief for the jobs, at the chart's appVersion), which the harness
# imported into every node (IfNotPresent, the chart's pull policy, finds them there). Only the
# status comes every second instead of every 5 (the tests wait on it).
CHART_VALUES = ("--set", "operator.statusInterval=1")


@pytest.fixture(scope="session")
def node_cluster(request: pytest.FixtureRequest) -> Iterator[nodes.NodeCluster]:
    reason = nodes.why_unavailable()
    if reason:
        unavailable(reason)
    for tool in ("kubectl", "helm"):
        if controlplane.tool(tool) is None:
            unavailable(f"no {tool}: `make kube-tools` fetches it")
    previous = signal.signal(signal.SIGTERM, interrupt_once)
    try:
        cluster = nodes.NodeCluster().start()
        nodes.NOTES.append(cluster.summary())
        try:
            yield cluster
        finally:
            keep = os.environ.get("DISTBELIEF_NODES_KEEP") == "1" or request.session.testsfailed > 0
            cluster.stop(keep=keep)
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupt_once(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a CI timeout, someone stopping the run) taken as Ctrl-C, so that pytest tears
    the session down: the nodes' processes run in sessions of their own and would outlive
    it. A second SIGTERM does not cut that teardown short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}: stopping the nodes")


@pytest.fixture(scope="session")
def control_plane(node_cluster: nodes.NodeCluster) -> nodes.NodeCluster:
    """support/cluster.py's kubectl, api, helm and namespace fixtures, on the nodes' control plane."""
    return node_cluster


@pytest.fixture(scope="session")
def release(node_cluster: nodes.NodeCluster, helm: Callable[..., str], kubectl: Kubectl) -> str:
    with nodes.Timed("helm install (--wait: the operator pod Ready)"):
        try:
            helm("install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace",
                 *CHART_VALUES, "--wait", "--timeout", "10m", timeout=660)
        except AssertionError:
            print(kubectl("describe", "pods", "-n", RELEASE_NAMESPACE, check=False)[-5000:])
            print(kubectl("logs", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/name=distbelief",
                          "--tail=50", check=False))
            raise
    kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    (deployment,) = kubectl.json("get", "deployment", "-n", RELEASE_NAMESPACE, "-l",
                                 "app.kubernetes.io/name=distbelief")["items"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert (container["image"], env.get("DISTBELIEF_RUNTIME_IMAGE")) == (nodes.OPERATOR_IMAGE, nodes.RUNTIME_IMAGE)
    assert not pod.get("hostNetwork"), "the operator runs on the pod network"
    return RELEASE_NAMESPACE


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not nodes.TIMINGS:
        return
    terminalreporter.section("nodes tier: phases")
    for note in nodes.NOTES:
        terminalreporter.write_line(note)
    for what, seconds in nodes.TIMINGS:
        terminalreporter.write_line(f"{seconds:8.1f} s  {what}")
