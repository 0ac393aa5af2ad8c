"""A session killed outright leaves its nodes' state behind; the next one takes it back
(support/reclaim.py), or `node up` and `node addons` refuse to start.

A fourth node, in a network namespace of its own, comes up and is then SIGKILLed with all it
runs, as when a machine's session ends. What it leaves (its network namespace, veth link,
route, iptables rules, cgroup, registry entry) is taken back while the session's three nodes
keep running, and a node started again in the same folder, which takes the same index,
comes up."""

from __future__ import annotations

import os
import re
import signal

import pytest

from support import reclaim
from support.cluster import Kubectl
from support.nodes import NICE, Daemon, NodeCluster, leftovers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
NAME = "node-killed"


def extra_node(cluster: NodeCluster) -> Daemon:
    folder = cluster.run_dir / NAME
    return Daemon(NAME, folder, ["up", str(folder), "--kubeconfig", str(cluster.kubeconfig), "--name", NAME,
                                 "--netns", "--nice", NICE], cluster.logs / f"{NAME}.out")


def index_of(node: Daemon) -> int:
    return int(re.search(r"^INDEX=(\d+)", (node.dir / "node.env").read_text(), re.M).group(1))


def of_index(items: set[str], index: int) -> set[str]:
    """The `node leftovers` items that are the node of that index's."""
    pattern = re.compile(rf"\b(kn|vkn|kbr){index}\b|\b10\.244\.{index}\.0/24|/run/kube-node: .*\b{index}\b")
    return {item for item in items if pattern.search(item)}


def test_a_sigkilled_node_is_taken_back_and_its_index_comes_up_again(node_cluster: NodeCluster,
                                                                    kubectl: Kubectl) -> None:
    node = extra_node(node_cluster).start()
    try:
        node.wait_ready()
        index = index_of(node)
        assert node.process is not None
        os.killpg(node.process.pid, signal.SIGKILL)      # `node up` and what shares its session
        node.process.wait()
        assert index in reclaim.left_indices() - reclaim.live_indices()
        assert of_index(leftovers()[0], index), "a SIGKILLed node left nothing: this test shows nothing"

        taken_back = reclaim.reclaim()

        assert any(f"node index {index}" in line for line in taken_back), taken_back
        assert not of_index(leftovers()[0], index)
        own = {int(n.env()["INDEX"]) for n in node_cluster.nodes}
        assert own <= reclaim.live_indices(), "the session's own nodes were touched"
        node.start().wait_ready()
        assert index_of(node) == index
        kubectl("wait", "--for=condition=Ready", f"node/{NAME}", "--timeout=120s", timeout=150)
    finally:
        if node.running():
            node.stop(timeout=300)
        else:       # failed between the kill and the new start
            reclaim.reclaim()
        kubectl("delete", "node", NAME, "--ignore-not-found", timeout=120)
    assert not of_index(leftovers()[0], index)
