"""A loud word when kopf's peering object is missing.

With peering on (the default), kopf pauses every handler until it can see its peering
object, and says so only at DEBUG level: an operator installed without the chart, or
run by hand, then sits silent and acts on no job. This watch logs a WARNING a few
seconds after start, and again periodically while the object stays missing, naming the
object and the two ways out.
"""

from __future__ import annotations

import logging
import os
import threading

from distbelief.operator import errors
from distbelief.operator.cluster.kube import Kube

log = logging.getLogger(__name__)

API_VERSION = "kopf.dev/v1"
FIRST_CHECK_SECONDS = 3.0
CHECK_SECONDS = float(os.environ.get("DISTBELIEF_PEERING_CHECK_SECONDS", "60"))


def missing(kube: Kube, name: str, namespaces: list[str]) -> list[str]:
    """The peering objects kopf needs and cannot find (all of them when their CRD is absent).
    Listed rather than read: the chart's RBAC lets the operator list peerings, not get them."""
    kind = "KopfPeering" if namespaces else "ClusterKopfPeering"
    absent = []
    scopes: list[str | None] = [*namespaces] or [None]  # None: cluster-wide
    for namespace in scopes:
        try:
            names = {obj["metadata"]["name"] for obj in kube.list(API_VERSION, kind, namespace, {})}
        except errors.KubeError as exc:
            if exc.status != 404:
                raise
            names = set()  # no such resource: the CRD is not installed
        if name not in names:
            absent.append(f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}")
    return absent


def watch(name: str, namespaces: list[str], stop: threading.Event) -> threading.Thread:
    """Check for the peering objects in a daemon thread until stop is set."""
    thread = threading.Thread(target=_loop, args=(name, namespaces, stop), name="peering-watch", daemon=True)
    thread.start()
    return thread


def _loop(name: str, namespaces: list[str], stop: threading.Event) -> None:
    kube, delay = Kube(), FIRST_CHECK_SECONDS
    while not stop.wait(delay):
        delay = CHECK_SECONDS
        try:
            absent = missing(kube, name, namespaces)
        except errors.KubeError as exc:
            log.warning("event=peering_check_failed peering=%s error=%r", name, str(exc))
            continue
        for obj in absent:
            log.warning("event=peering_missing object=%r (kopf.dev/v1) consequence=%r fix=%r", obj,
                        "kopf pauses this operator: no job is handled until the object exists",
                        "install kopf's peering CRDs and the object (the Helm chart does), or run the "
                        "operator with --standalone")
