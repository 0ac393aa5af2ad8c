"""The operator's few calls to the Kubernetes API, over the official client's transport.

Objects are plain dicts, addressed by apiVersion and kind. `apply` is idempotent: it
creates what is missing and merge-patches what differs, leaving fields the API server
will not change (a StatefulSet's volume claim templates, selectors) out of the patch.
API errors are translated here into KubeError with the verb, the object and the reason.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from distbelief.runtime import contract

log = logging.getLogger(__name__)

Manifest = dict[str, Any]

# apiVersion/kind -> plural. Every kind the operator touches, and nothing more.
PLURALS = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("v1", "Secret"): "secrets",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    (contract.JOB_API_VERSION, contract.KIND): contract.PLURAL,
    ("kopf.dev/v1", "KopfPeering"): "kopfpeerings",
    ("kopf.dev/v1", "ClusterKopfPeering"): "clusterkopfpeerings",
}
# Fields the API server refuses to change after creation.
IMMUTABLE = {
    "StatefulSet": ("selector", "serviceName", "volumeClaimTemplates", "podManagementPolicy"),
    "Deployment": ("selector",),
    "Service": ("clusterIP", "clusterIPs", "selector"),
}


class KubeError(RuntimeError):
    def __init__(self, verb: str, what: str, exc: ApiException) -> None:
        self.status = exc.status
        reason = exc.reason
        try:
            reason = json.loads(exc.body).get("message", reason)
        except (TypeError, ValueError):
            pass
        super().__init__(f"{verb} {what}: {exc.status} {reason}")


def path_of(api_version: str, kind: str, namespace: str | None, name: str | None = None,
            subresource: str | None = None) -> str:
    plural = PLURALS[(api_version, kind)]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [base] + ([f"namespaces/{namespace}"] if namespace else []) + [plural]
    parts += [name] if name else []
    parts += [subresource] if subresource else []
    return "/".join(parts)


class Kube:
    def __init__(self, api: k8s.ApiClient | None = None) -> None:
        self.api = api or k8s.ApiClient()

    def _call(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
              query: list[tuple[str, str]] | None = None) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, _, _ = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, auth_settings=["BearerToken"])
        # The client serialises the body itself for every JSON content type (+json too).
        response = self.api.call_api(method, url, header_params=headers, body=body, _request_timeout=30)
        data = response.read()
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(http_resp=response, body=data.decode(errors="replace"), data=None)
        return json.loads(data) if data else None

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        try:
            return self._call("GET", path_of(api_version, kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise KubeError("get", f"{kind} {namespace}/{name}", exc) from exc

    def list(self, api_version: str, kind: str, namespace: str | None, selector: Mapping[str, str]) -> list[Manifest]:
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in selector.items()))]
        try:
            return self._call("GET", path_of(api_version, kind, namespace), query=query).get("items", [])
        except ApiException as exc:
            raise KubeError("list", f"{kind} in {namespace}", exc) from exc

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete in the background (the garbage collector takes the children); False if absent."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            self._call("DELETE", path_of(api_version, kind, namespace, name), body=body)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise KubeError("delete", f"{kind} {namespace}/{name}", exc) from exc
        return True

    def create(self, desired: Manifest) -> Manifest | None:
        """Create desired if no object of its name exists; never touch an existing one.
        The object as created (with its uid), or None if one of that name was there."""
        api_version, kind = desired["apiVersion"], desired["kind"]
        namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
        try:
            return self._call("POST", path_of(api_version, kind, namespace), body=desired) or {}
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise KubeError("create", f"{kind} {namespace}/{name}", exc) from exc

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: Manifest) -> None:
        """Merge-patch the named object."""
        try:
            self._call("PATCH", path_of(api_version, kind, namespace, name), body=patch,
                       content_type="application/merge-patch+json")
        except ApiException as exc:
            raise KubeError("patch", f"{kind} {namespace}/{name}", exc) from exc

    def apply(self, desired: Manifest, *, likely_absent: bool = False) -> str:
        """Create desired, or patch the live object toward it. Returns created|patched|unchanged.

        likely_absent (a new job's children): try the create first, which saves the read
        when it succeeds and costs one request more when the object was there after all."""
        api_version, kind = desired["apiVersion"], desired["kind"]
        namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
        live = None if likely_absent else self.get(api_version, kind, namespace, name)
        if live is None:
            if self.create(desired) is not None:
                return "created"
            live = self.get(api_version, kind, namespace, name) or {}  # created meanwhile: patch it
        patch = _mutable_part(desired)
        if _contains(live, patch):
            return "unchanged"
        self.patch(api_version, kind, namespace, name, patch)
        return "patched"


def _mutable_part(desired: Manifest) -> Manifest:
    patch = json.loads(json.dumps(desired))
    for field in IMMUTABLE.get(desired["kind"], ()):
        patch.get("spec", {}).pop(field, None)
    return patch


def _contains(live: Any, wanted: Any) -> bool:
    """Whether live already holds every value of wanted (lists compared whole)."""
    if isinstance(wanted, dict):
        return isinstance(live, dict) and all(_contains(live.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(live, list) and len(live) == len(wanted) and all(map(_contains, live, wanted))
    return live == wanted
