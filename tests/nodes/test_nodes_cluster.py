"""The nodes tier's cluster itself: three real nodes Ready (one in this machine's network
namespace, two in their own), and CoreDNS answering pods on every node: Services, the
per-pod names of a headless Service across nodes (how the operator reaches a job's chief),
and names outside the cluster."""

from __future__ import annotations

import ipaddress
import json
import socket
from typing import Any

import pytest
import yaml

from support import nodes
from support.cluster import Kubectl, unavailable
from support.waiting import eventually

pytestmark = pytest.mark.timeout(3600)   # the first test also starts the session's cluster

# Each probe pod resolves these (<ns>: its namespace) until all answer or 90 s pass, prints
# one JSON line, then stays (its record must stay for the others).
PROBE = """
import json, os, socket, sys, time
names = json.loads(sys.argv[1])
found = {}
deadline = time.monotonic() + 90
while time.monotonic() < deadline and len(found) < len(names):
    for name in names:
        if name not in found:
            try:
                found[name] = sorted({a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET)})
            except OSError:
                pass
    time.sleep(0.5)
print(json.dumps({"resolv": open("/etc/resolv.conf").read(), "found": found}), flush=True)
time.sleep(3600)
"""


def nodes_of(kubectl: Kubectl) -> list[dict[str, Any]]:
    return kubectl.json("get", "nodes")["items"]


def test_three_real_nodes_are_ready_one_in_the_hosts_network_two_in_their_own(
        node_cluster: nodes.NodeCluster, kubectl: Kubectl) -> None:
    found = {n["metadata"]["name"]: n for n in nodes_of(kubectl)}
    assert sorted(found) == sorted(name for name, _ in nodes.NODES)
    for name, node in found.items():
        ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True", (name, ready)
        assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.36.2"
        assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    netns = {name: node["metadata"]["labels"]["kube-node/netns"] for name, node in found.items()}
    assert sorted(netns.values()) == ["false", "true", "true"]
    addresses = {name: next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
                 for name, node in found.items()}
    assert len(set(addresses.values())) == 3
    # node2's link to the host: a tc tbf at 1gbit on the host's end (and on the node's)
    shaped = next(n for n in node_cluster.nodes if "--rate" in n.options)
    qdiscs = nodes.run(["tc", "qdisc", "show", "dev", f"vkn{shaped.env()['INDEX']}"], timeout=30).stdout
    assert "qdisc tbf" in qdiscs and "rate 1Gbit" in qdiscs, qdiscs


def test_coredns_answers_services_pod_names_across_nodes_and_outside_names_on_every_node(
        node_cluster: nodes.NodeCluster, kubectl: Kubectl, namespace: str) -> None:
    if node_cluster.dns != "coredns":
        unavailable(f"CoreDNS could not be built, the dnsmasq stand-in serves DNS: {node_cluster.dns_note}")
    node_names = [name for name, _ in nodes.NODES]
    names: dict[str, list[str] | None] = {"kubernetes.default.svc.cluster.local": ["10.0.0.1"],
                                          "kube-dns.kube-system": [nodes.DNS_IP]}   # short: the search path
    names.update({f"probe-{n}.probes.{namespace}.svc.cluster.local": None for n in node_names})
    outside = "pypi.org"
    try:
        socket.getaddrinfo(outside, None, socket.AF_INET)
        names[outside] = None        # this machine resolves it: so must the pods (CoreDNS forwards it)
    except OSError:
        pass
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "probes"},
               "spec": {"clusterIP": "None", "selector": {"app": "probe"}, "ports": [{"port": 80}]}}
    pods = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"probe-{n}", "labels": {"app": "probe"}},
             "spec": {"nodeName": n, "hostname": f"probe-{n}", "subdomain": "probes", "restartPolicy": "Never",
                      "terminationGracePeriodSeconds": 1, "automountServiceAccountToken": False,
                      "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
                      "containers": [{"name": "probe", "image": nodes.RUNTIME_IMAGE, "imagePullPolicy": "Never",
                                      "command": ["python", "-c", PROBE, json.dumps(list(names))]}]}}
            for n in node_names]
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all([service, *pods]))

    def reports() -> dict[str, dict[str, Any]] | None:
        out = {}
        for n in node_names:
            log = kubectl.run("logs", "-n", namespace, f"probe-{n}").stdout.strip()
            if not log:
                return None
            out[n] = json.loads(log.splitlines()[0])
        return out

    found = eventually(reports, 300, interval=2, what="every probe pod's report")
    ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in kubectl.json("get", "pods", "-n", namespace)["items"]}
    for node in node_cluster.nodes:      # each pod in its own node's pod CIDR
        assert ipaddress.ip_address(ips[f"probe-{node.name}"]) in ipaddress.ip_network(node.env()["POD_CIDR"])
    for node, report in found.items():
        assert f"nameserver {nodes.DNS_IP}" in report["resolv"], (node, report["resolv"])
        assert set(report["found"]) == set(names), (node, sorted(set(names) - set(report["found"])))
        for name, expected in names.items():
            if expected is not None:
                assert report["found"][name] == expected, (node, name, report["found"][name])
        for n in node_names:
            assert report["found"][f"probe-{n}.probes.{namespace}.svc.cluster.local"] == [ips[f"probe-{n}"]]
    kubectl("delete", "pods", "-n", namespace, "--all", "--wait=false")
