"""The operator's few calls to the Kubernetes API, over the official client's transport
(and those of `kubectl distbelief`: Events by field, a pod's log or metrics as text).

Objects are plain dicts, addressed by apiVersion and kind. `apply` is idempotent: it
creates what is missing and merge-patches what differs, leaving fields the API server
will not change (a StatefulSet's volume claim templates, selectors) out of the patch.
It changes only what its owner controls: a live object of the same name without the
desired object's controller reference (someone else's) is left alone and reported as
"foreign"; `delete_owned` likewise. API errors are translated here, and only here,
into errors.KubeError with the verb, the object and the reason.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from typing import Any, Literal, Mapping

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from distbelief.operator import errors
from distbelief.operator.render import kinds, podparts

log = logging.getLogger(__name__)

Manifest = dict[str, Any]

# Fields the API server refuses to change after creation.
IMMUTABLE = {
    "StatefulSet": ("selector", "serviceName", "volumeClaimTemplates", "podManagementPolicy"),
    "Deployment": ("selector",),
    "Service": ("clusterIP", "clusterIPs", "selector"),
}


Applied = Literal["created", "patched", "unchanged", "foreign"]


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of obj's controller (the owner reference marked controller), if it has one."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((ref.get("uid") for ref in refs if ref.get("controller")), None)


def _failed(verb: str, what: str, exc: ApiException) -> errors.KubeError:
    """The one translation of the client's ApiException: the API server's own message when
    its body carries one, else the HTTP reason."""
    reason = exc.reason
    try:
        reason = json.loads(exc.body).get("message", reason)
    except (TypeError, ValueError, AttributeError):
        pass
    return errors.KubeError(verb, what, exc.status, reason)


def path_of(api_version: str, kind: str, namespace: str | None, name: str | None = None,
            subresource: str | None = None) -> str:
    plural = kinds.PLURALS[(api_version, kind)]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [base] + ([f"namespaces/{namespace}"] if namespace else []) + [plural]
    parts += [name] if name else []
    parts += [subresource] if subresource else []
    return "/".join(parts)


# Requests this process's Kube clients sent, by method and resource (kopf's own watches and
# patches aside): the operator's metrics show them (metrics.py, distbelief_operator_api_requests).
_REQUESTS: collections.Counter[tuple[str, str]] = collections.Counter()
_REQUESTS_LOCK = threading.Lock()


def requests_sent() -> dict[tuple[str, str], int]:
    with _REQUESTS_LOCK:
        return dict(_REQUESTS)


def resource_of(path: str) -> str:
    """The resource (plural) a request's path names: /api/v1/namespaces/ns/pods/x -> pods."""
    parts = path.split("?")[0].strip("/").split("/")
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        rest = rest[2:]
    return rest[0] if rest else ""


# The operator process's one client (share_one_client); None elsewhere (kubectl distbelief,
# tests), where each Kube() builds its own from the default configuration of the moment.
_SHARED: k8s.ApiClient | None = None


def share_one_client(connections: int) -> None:
    """From now on every Kube() of this process uses one client, built here from the default
    configuration, with a pool of up to `connections` kept-alive connections (urllib3's
    pool is thread-safe). A client per call would open, and pay a TLS handshake for, a
    connection per call."""
    global _SHARED
    configuration = k8s.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = connections
    _SHARED = k8s.ApiClient(configuration)


class Kube:
    def __init__(self, api: k8s.ApiClient | None = None) -> None:
        self.api = api or _SHARED or k8s.ApiClient()

    def _call(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
              query: list[tuple[str, str]] | None = None) -> Any:
        data = self._request(method, path, body=body, content_type=content_type, query=query).read()
        return json.loads(data) if data else None

    def _request(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
                 query: list[tuple[str, str]] | None = None, timeout: Any = 30) -> Any:
        """The client's response, its body not read yet (ApiException when not 2xx)."""
        headers = {"Accept": "application/json, */*", "Content-Type": content_type}
        with _REQUESTS_LOCK:
            _REQUESTS[method, resource_of(path)] += 1
        method, url, headers, _, _ = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, auth_settings=["BearerToken"])
        # The client serialises the body itself for every JSON content type (+json too).
        response = self.api.call_api(method, url, header_params=headers, body=body, _request_timeout=timeout)
        if not 200 <= response.status <= 299:
            data = response.read()
            raise ApiException.from_response(http_resp=response, body=data.decode(errors="replace"), data=None)
        return response

    def read_text(self, what: str, path: str, query: list[tuple[str, str]] | None = None) -> str:
        """The body of GET path as text (a pod's log, a pod's metrics through the API server's proxy)."""
        try:
            return self._request("GET", path, query=query).read().decode(errors="replace")
        except ApiException as exc:
            raise _failed("get", what, exc) from exc

    def stream_lines(self, what: str, path: str, query: list[tuple[str, str]] | None = None) -> Iterator[bytes]:
        """The lines of GET path as the server sends them (a followed log), with no read timeout."""
        try:
            response = self._request("GET", path, query=query, timeout=(10, None))
        except ApiException as exc:
            raise _failed("get", what, exc) from exc
        with contextlib.closing(response.response) as body:
            yield from body

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        try:
            return self._call("GET", path_of(api_version, kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise _failed("get", f"{kind} {namespace}/{name}", exc) from exc

    def list(self, api_version: str, kind: str, namespace: str | None, selector: Mapping[str, str],
             fields: Mapping[str, str] | None = None) -> list[Manifest]:
        """The objects whose labels (and with fields, whose fields) hold those values; every
        namespace when namespace is None."""
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in selector.items()))]
        if fields:
            query.append(("fieldSelector", ",".join(f"{k}={v}" for k, v in fields.items())))
        try:
            return self._call("GET", path_of(api_version, kind, namespace), query=query).get("items", [])
        except ApiException as exc:
            raise _failed("list", f"{kind} in {namespace}", exc) from exc

    def delete(self, api_version: str, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        """Delete in the background (the garbage collector takes the children); False if absent.
        With uid, only the object of that uid (a 409 if the name now holds another)."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self._call("DELETE", path_of(api_version, kind, namespace, name), body=body)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise _failed("delete", f"{kind} {namespace}/{name}", exc) from exc
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
            raise _failed("create", f"{kind} {namespace}/{name}", exc) from exc

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: Manifest, *,
              subresource: str | None = None) -> None:
        """Merge-patch the named object (or its subresource: "status")."""
        try:
            self._call("PATCH", path_of(api_version, kind, namespace, name, subresource), body=patch,
                       content_type="application/merge-patch+json")
        except ApiException as exc:
            raise _failed("patch", f"{kind} {namespace}/{name}", exc) from exc

    def delete_owned(self, api_version: str, kind: str, namespace: str, name: str,
                     owner_uid: str) -> Literal["deleted", "absent", "foreign"]:
        """Delete the named object if owner_uid controls it; leave anyone else's alone."""
        live = self.get(api_version, kind, namespace, name)
        if live is None:
            return "absent"
        if controller_uid(live) != owner_uid:
            return "foreign"
        return "deleted" if self.delete(api_version, kind, namespace, name, uid=live["metadata"]["uid"]) else "absent"

    def apply(self, desired: Manifest, *, likely_absent: bool = False, live: Manifest | None = None) -> Applied:
        """Create desired, or patch the live object toward it: created|patched|unchanged, or
        foreign (changed nothing) when an object of that name exists that the controller
        named in desired's owner references does not control.

        likely_absent (a new job's children): try the create first, which saves the read
        when it succeeds and costs one request more when the object was there after all.
        live: the object as just read (a watch event), which saves the read."""
        api_version, kind = desired["apiVersion"], desired["kind"]
        namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
        if live is None and not likely_absent:
            live = self.get(api_version, kind, namespace, name)
        if live is None:
            if self.create(desired) is not None:
                return "created"
            live = self.get(api_version, kind, namespace, name) or {}  # created meanwhile: patch it
        owner = controller_uid(desired)
        if owner is not None and controller_uid(live) != owner:
            log.warning("event=foreign_object kind=%s namespace=%s name=%s controller=%s action=left_alone",
                        kind, namespace, name, controller_uid(live))
            return "foreign"
        patch = mutable_part(desired)
        if _contains(live, patch):
            return "unchanged"
        # The uid makes the patch conditional: should the name now hold another object (ours
        # deleted and someone else's made in between), the server refuses to change its uid.
        patch["metadata"]["uid"] = live["metadata"]["uid"]
        self.patch(api_version, kind, namespace, name, patch)
        return "patched"


def mutable_part(desired: Manifest) -> Manifest:
    """desired without the fields the server refuses to change after creation: what a patch
    sends, and what a live object must hold to match."""
    patch = json.loads(json.dumps(desired))
    for field in IMMUTABLE.get(desired["kind"], ()):
        patch.get("spec", {}).pop(field, None)
    return patch


def contains(live: Any, wanted: Any) -> bool:
    """Whether live already holds every value of wanted (lists compared whole)."""
    return _contains(live, wanted)


# Maps of resource quantities: the server stores them in its canonical form ("0.5" as "500m").
_QUANTITY_MAPS = ("requests", "limits")


def _contains(live: Any, wanted: Any, quantities: bool = False) -> bool:
    if isinstance(wanted, dict):
        return isinstance(live, dict) and all(_contains(live.get(k), v, quantities or k in _QUANTITY_MAPS)
                                              for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(live, list) and len(live) == len(wanted) and all(map(_contains, live, wanted))
    if quantities and live != wanted:
        return _quantity(live) is not None and _quantity(live) == _quantity(wanted)
    return live == wanted


def _quantity(value: Any) -> Decimal | None:
    """A resource quantity ("500m", "0.5", 2, "1Gi") as a number; None when it is not one."""
    try:
        return podparts.cpu_cores(value)
    except (InvalidOperation, ValueError):
        return None
