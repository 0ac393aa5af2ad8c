"""The node agent's calls to the Kubernetes API: plain dicts by URL path, over the operator's
transport (kube.Kube), with the few verbs a kubelet needs that the operator does not use
(field selectors, the status subresource, delete with a grace period and a uid precondition).
"""

from __future__ import annotations

from typing import Any, Mapping

from kubernetes import client as k8s, config as k8s_config
from kubernetes.client.rest import ApiException

from distbelief.operator.cluster import kube

Manifest = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"


def client_from(kubeconfig: str) -> k8s.ApiClient:
    """An API client of the kubeconfig file's current context (never of $KUBECONFIG)."""
    configuration = k8s.Configuration()
    k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    return k8s.ApiClient(configuration)


def path(group_version: str, plural: str, namespace: str | None = None, name: str | None = None,
         subresource: str | None = None) -> str:
    """The URL path of a collection or an object: path("v1", "pods", "ns", "p", "status")."""
    base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    parts = [base, *([f"namespaces/{namespace}"] if namespace else []), plural]
    return "/".join(parts + [p for p in (name, subresource) if p])


class Api(kube.Kube):
    """get / list / create / merge-patch / delete by path; ApiException for every error
    but the absences the callers expect (get of a missing object: None)."""

    @property
    def server(self) -> str:
        return str(self.api.configuration.host)

    def get_path(self, where: str) -> Manifest | None:
        try:
            return self._call("GET", where)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list_path(self, where: str, *, fields: Mapping[str, str] | None = None) -> list[Manifest]:
        query = [("fieldSelector", ",".join(f"{k}={v}" for k, v in fields.items()))] if fields else []
        return (self._call("GET", where, query=query) or {}).get("items", [])

    def create_path(self, where: str, body: Manifest) -> Manifest | None:
        """The object as created, or None when one of its name exists."""
        try:
            return self._call("POST", where, body=body)
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise

    def patch_path(self, where: str, body: Manifest) -> Manifest | None:
        """Merge-patch (RFC 7386: lists are replaced whole); None when the object is gone."""
        try:
            return self._call("PATCH", where, body=body, content_type=MERGE_PATCH)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def delete_path(self, where: str, *, grace_seconds: int | None = None, uid: str | None = None) -> bool:
        """Delete; False when the object is gone already (or is another one of the same name)."""
        body: Manifest = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self._call("DELETE", where, body=body)
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True
