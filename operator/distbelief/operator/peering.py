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

from distbelief.operator.kube import Kube, KubeError

log = logging.getLogger(__name__)

API_VERSION = "kopf.dev/v1"
FIRST_CHECK_SECONDS = 3.0
CHECK_SECONDS = float(os.environ.get("DISTBELIEF_PEERING_CHECK_SECONDS", "60"))


def missing(kube: Kube, name: str, namespaces: list[str]) -> list[str]:
    """The peering objects kopf needs and cannot find (all of them when their CRD is absent)."""
    if not namespaces:
        found = kube.get(API_VERSION, "ClusterKopfPeering", None, name)
        return [] if found else [f"ClusterKopfPeering {name}"]
    return [f"KopfPeering {namespace}/{name}" for namespace in namespaces
            if kube.get(API_VERSION, "KopfPeering", namespace, name) is None]


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
        except KubeError as exc:
            log.warning("event=peering_check_failed peering=%s error=%r", name, str(exc))
            continue
        for obj in absent:
            log.warning("event=peering_missing object=%r (kopf.dev/v1) consequence=%r fix=%r", obj,
                        "kopf pauses this operator: no job is handled until the object exists",
                        "install kopf's peering CRDs and the object (the Helm chart does), or run the "
                        "operator with --standalone")
