"""Pod IPs and cluster DNS names on one machine.

Every pod gets an IP of its own from 127.64.0.0/10: Linux routes all of 127.0.0.0/8 to the
loopback interface, so each pod serves its container ports unchanged (7070, 9100, ...) on
its own address, and no two pods clash. The address is a hash of the cluster's identity
(the kube-system namespace's uid), the pod's namespace and its name. So it is known
before the pod exists, a StatefulSet pod that comes back under its name gets its old
address again, and two clusters on one machine (two test sessions) do not collide.

There is no cluster DNS here: a name of a headless Service's pod,
`<pod>.<service>.<namespace>.svc[.cluster.local]`, maps to that pod's address through
resolve(), which the agent uses to tell pods where their peers are (roles.py) and to
proxy requests to pods by name (endpoint.py).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import urllib.parse

from kubernetes.client.rest import ApiException

from localnode import api as node_api

log = logging.getLogger(__name__)

POD_NETWORK = ipaddress.ip_network("127.64.0.0/10")
HOST_IP = "127.0.0.1"
CLUSTER_DOMAINS = (".svc.cluster.local", ".svc")


def cluster_identity(api: node_api.Api) -> str:
    """The kube-system namespace's uid (the usual cluster id), else the API server's URL."""
    try:
        found = api.get_path(node_api.path("v1", "namespaces", name="kube-system"))
    except ApiException as exc:
        log.warning("event=cluster_id_unreadable status=%s fallback=server_url", exc.status)
        found = None
    return (found or {}).get("metadata", {}).get("uid") or api.server


class PodNetwork:
    """The pod IPs of one cluster."""

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster

    def ip(self, namespace: str, pod: str) -> str:
        digest = hashlib.sha256(f"{self.cluster}/{namespace}/{pod}".encode()).digest()
        offset = int.from_bytes(digest[:4], "big") % POD_NETWORK.num_addresses
        if offset % 256 in (0, 255):  # no .0 or .255: they read as network and broadcast addresses
            offset ^= 1
        return str(POD_NETWORK.network_address + offset)

    def resolve(self, host: str) -> str | None:
        """The pod IP a cluster DNS name of a pod stands for; None for any other name."""
        for domain in CLUSTER_DOMAINS:
            if host.endswith(domain):
                labels = host[: -len(domain)].split(".")
                if len(labels) == 3:  # <pod>.<service>.<namespace>
                    return self.ip(labels[2], labels[0])
                return None
        return None

    def map_url(self, url: str) -> str:
        """url with a pod's cluster DNS name replaced by its IP (tcp://, http://; other names kept)."""
        parts = urllib.parse.urlsplit(url)
        ip = self.resolve(parts.hostname or "")
        if ip is None:
            return url
        netloc = ip + (f":{parts.port}" if parts.port else "")
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
