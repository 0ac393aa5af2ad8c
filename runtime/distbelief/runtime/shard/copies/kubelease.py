"""A shard's view record in a coordination.k8s.io/v1 Lease: the ViewStore of copies on a
cluster (viewstore.py).

The Lease is named by contract.JobNames.shard_lease(i) in the job's namespace. Its
resourceVersion is the record's version: an update that names a resourceVersion that is
no longer current is refused by the API server with 409 Conflict, which is the
compare-and-swap (and a create of a Lease that exists meanwhile, likewise). The lease
fields say what they mean (holderIdentity: the primary's incarnation, renewTime,
leaseDurationSeconds, leaseTransitions: the view); the rest of the record is in
annotations (ANNOTATIONS). A copy creates the Lease if absent, owned by its ServiceAccount
(<job>-ps, the job's child): the Lease goes when the job does.

The pods need get, create and update on leases: the Role the operator renders beside the
StatefulSet (render.render_ps_access).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
from typing import Any

from distbelief.runtime import contract
from distbelief.runtime.shard.copies.kubeapi import KubeApi, message
from distbelief.runtime.shard.copies.viewstore import StoreUnavailable, ViewRecord

log = logging.getLogger(__name__)

GROUP = contract.API_GROUP
ANNOTATIONS = {"view": f"{GROUP}/view", "primary": f"{GROUP}/primary", "inSync": f"{GROUP}/in-sync",
               "leaseSeconds": f"{GROUP}/lease-seconds", "failovers": f"{GROUP}/failovers"}
MICROTIME = "%Y-%m-%dT%H:%M:%S.%fZ"


class LeaseViewStore:
    def __init__(self, api: KubeApi, *, namespace: str, name: str, labels: dict[str, str] | None = None,
                 owner: dict[str, Any] | None = None) -> None:
        self.api, self.namespace, self.name = api, namespace, name
        self.labels, self.owner = dict(labels or {}), owner
        self._path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self._metadata: dict[str, Any] = {}  # of the Lease last read: kept whole by an update

    def describe(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    def read(self) -> tuple[ViewRecord | None, str]:
        status, body = self.api.call("GET", f"{self._path}/{self.name}")
        if status == 404:
            return None, ""
        if status != 200 or not isinstance(body, dict):
            raise StoreUnavailable(self._failed("read", status, body))
        self._metadata = body.get("metadata", {})
        return _record(body), str(self._metadata.get("resourceVersion", ""))

    def compare_and_swap(self, version: str, record: ViewRecord) -> str | None:
        lease = self._lease(record, version)
        if version:
            status, body = self.api.call("PUT", f"{self._path}/{self.name}", lease)
        else:
            status, body = self.api.call("POST", self._path, lease)
        if status == 409:
            return None  # another write came first (or the Lease was created meanwhile)
        if status == 404 and version:
            return None  # deleted: the next read sees no record
        if status not in (200, 201) or not isinstance(body, dict):
            raise StoreUnavailable(self._failed("update" if version else "create", status, body))
        self._metadata = body.get("metadata", {})
        return str(self._metadata.get("resourceVersion", ""))

    def _lease(self, record: ViewRecord, version: str) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if version:
            kept = {k: v for k, v in self._metadata.items() if k in ("labels", "ownerReferences", "annotations")}
            metadata.update(kept, resourceVersion=version)
        else:
            metadata["labels"] = dict(self.labels)
            if self.owner:
                metadata["ownerReferences"] = [self.owner]
        value = record.to_json()
        metadata["annotations"] = {**metadata.get("annotations", {}),
                                   **{annotation: json.dumps(value[field]) for field, annotation in ANNOTATIONS.items()}}
        renewed = datetime.datetime.fromtimestamp(record.renewed, datetime.timezone.utc)
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
                "spec": {"holderIdentity": record.holder, "leaseDurationSeconds": max(1, math.ceil(record.lease_seconds)),
                         "renewTime": renewed.strftime(MICROTIME), "leaseTransitions": record.view}}

    def _failed(self, verb: str, status: int, body: Any) -> str:
        why = message(body)
        if status in (401, 403):
            why += (" (the shard pods' ServiceAccount needs get, create and update on leases: the Role "
                    f"{self.name.rsplit('-shard-', 1)[0]}-ps the operator renders)")
        return f"cannot {verb} Lease {self.namespace}/{self.name}: HTTP {status} {why}".rstrip()


def _record(lease: dict[str, Any]) -> ViewRecord | None:
    annotations = lease.get("metadata", {}).get("annotations") or {}
    if ANNOTATIONS["view"] not in annotations:
        return None  # a Lease made by someone else, without a view yet: no record
    spec = lease.get("spec") or {}
    try:
        value = {field: json.loads(annotations[a]) for field, a in ANNOTATIONS.items()}
    except (KeyError, ValueError) as exc:
        raise StoreUnavailable(f"Lease {lease['metadata'].get('name')} has unreadable annotations: {exc}") from exc
    renewed = spec.get("renewTime")
    try:
        seconds = datetime.datetime.strptime(renewed, MICROTIME).replace(tzinfo=datetime.timezone.utc).timestamp() \
            if renewed else 0.0
    except ValueError:
        seconds = 0.0
    return ViewRecord.from_json({**value, "holder": spec.get("holderIdentity", ""), "renewed": seconds})


def service_account_owner(api: KubeApi) -> dict[str, Any] | None:
    """An ownerReference to the pod's own ServiceAccount, when its token names it."""
    account = api.account()
    if account is None:
        return None
    return {"apiVersion": "v1", "kind": "ServiceAccount", "name": account[0], "uid": account[1]}
