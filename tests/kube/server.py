"""The HTTP face of the emulator: Kubernetes API paths over aiohttp, onto a :class:`Store`.

Routing is by hand, the way the API server's paths are built::

    /api/v1[/namespaces/NS]/PLURAL[/NAME[/SUBRESOURCE]]
    /apis/GROUP/VERSION[/namespaces/NS]/PLURAL[/NAME[/SUBRESOURCE]]

with the one special case that ``/api/v1/namespaces/NAME[/status]`` is the Namespace
object itself. Discovery, ``/version`` and health endpoints are served from the
catalog; everything else is an API verb on the store. Answers are JSON; failures are
metav1 Status objects; watches are chunked JSON lines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any

from aiohttp import web

from . import objects
from .catalog import ResourceType
from .store import ApiError, Store, Watch

log = logging.getLogger(__name__)

VERSION_INFO = {
    "major": "1", "minor": "30", "gitVersion": "v1.30.0", "gitCommit": "0" * 40, "gitTreeState": "clean",
    "buildDate": "2024-04-17T00:00:00Z", "goVersion": "go1.22.2", "compiler": "gc", "platform": "linux/amd64",
}
JSON = "application/json"
IDLE_CHECK = 0.5  # seconds between checks that a quiet watch's client is still there


@dataclasses.dataclass
class RequestRecord:
    """One request the server answered, for tests to assert on what a client did."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str
    code: int = 0


@dataclasses.dataclass(frozen=True)
class Target:
    rt: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


class ApiServer:
    def __init__(self, store: Store, version_info: dict[str, str] | None = None) -> None:
        self.store = store
        self.version_info = dict(version_info or VERSION_INFO)
        self.requests: list[RequestRecord] = []
        self.stopping = asyncio.Event()
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_route("*", "/{path:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        record = RequestRecord(request.method, request.path, dict(request.query),
                               request.headers.get("Content-Type", ""))
        self.requests.append(record)
        try:
            response = await self._dispatch(request)
        except ApiError as exc:
            response = _json(exc.status(), exc.code)
        except Exception as exc:  # a bug in the emulator: say so to the client and the test log
            log.exception("emulator failed on %s %s", request.method, request.path_qs)
            response = _json(ApiError(500, "InternalError", f"emulator error: {exc!r}").status(), 500)
        record.code = response.status
        return response

    # ------------------------------------------------------------------ routing

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        catalog = self.store.catalog
        if request.method == "GET":
            if not parts:
                return _json({"paths": ["/api", "/api/v1", "/apis", "/healthz", "/livez", "/readyz", "/version"]})
            if parts == ["version"]:
                return _json(self.version_info)
            if parts[0] in ("healthz", "livez", "readyz"):
                return web.Response(text="ok")
            if parts == ["api"]:
                return _json(catalog.api_versions())
            if parts == ["apis"]:
                return _json(catalog.api_group_list())
            discovery = (catalog.api_resource_list("", parts[1]) if parts[0] == "api" and len(parts) == 2 else
                         catalog.api_group(parts[1]) if parts[0] == "apis" and len(parts) == 2 else
                         catalog.api_resource_list(parts[1], parts[2]) if parts[0] == "apis" and len(parts) == 3
                         else None)
            if discovery is not None:
                return _json(discovery)
        target = self._target(parts)
        query = request.query
        dry_run = query.get("dryRun") == "All"
        method = request.method
        if method == "GET" and query.get("watch") in ("true", "1"):
            return await self._watch(request, target)
        if method == "GET" and target.name is None:
            items, rv = self.store.list(target.rt, target.namespace, query.get("labelSelector"),
                                        query.get("fieldSelector"))
            if _wants_table(request):
                return _json(objects.table(target.rt, items, rv, query.get("includeObject", "PartialObjectMetadata")))
            return _json({"kind": f"{target.rt.kind}List", "apiVersion": target.rt.api_version,
                          "metadata": {"resourceVersion": rv}, "items": items})
        if method == "GET":
            obj = self.store.get(target.rt, target.namespace, target.name, target.subresource)
            if _wants_table(request) and target.subresource is None:
                return _json(objects.table(target.rt, [obj], obj["metadata"]["resourceVersion"],
                                           query.get("includeObject", "PartialObjectMetadata")))
            return _json(obj)
        if method == "POST" and target.name is None:
            if target.rt.namespaced and target.namespace is None:
                raise ApiError(405, "MethodNotAllowed", "create a namespaced object under /namespaces/NAMESPACE/")
            return _json(self.store.create(target.rt, target.namespace, await _body(request), dry_run=dry_run), 201)
        if target.name is None:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on a collection by the emulator")
        if method == "PUT":
            return _json(self.store.replace(target.rt, target.namespace, target.name, await _body(request),
                                            subresource=target.subresource, dry_run=dry_run))
        if method == "PATCH":
            content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
            return _json(self.store.patch(target.rt, target.namespace, target.name, await _body(request),
                                          content_type, subresource=target.subresource, dry_run=dry_run))
        if method == "DELETE" and target.subresource is None:
            options = await _body(request, required=False) or {}
            propagation = query.get("propagationPolicy") or options.get("propagationPolicy")
            if options.get("orphanDependents") is True and not propagation:
                propagation = "Orphan"
            obj, gone = self.store.delete(target.rt, target.namespace, target.name, propagation=propagation,
                                          preconditions=options.get("preconditions"), dry_run=dry_run)
            if gone and not target.rt.custom:
                meta = obj["metadata"]
                return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                              "details": {"name": meta["name"], "group": target.rt.group,
                                          "kind": target.rt.plural, "uid": meta["uid"]}})
            return _json(obj)
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")

    def _target(self, parts: list[str]) -> Target:
        if len(parts) >= 3 and parts[0] == "api":
            group, rest = "", parts[1:]
        elif len(parts) >= 4 and parts[0] == "apis":
            group, rest = parts[1], parts[2:]
        else:
            raise ApiError.not_found()
        version, rest = rest[0], rest[1:]
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces" and not (len(rest) == 3 and rest[2] in ("status", "finalize")):
            namespace, rest = rest[1], rest[2:]
        if len(rest) > 3:
            raise ApiError.not_found()
        rt = self.store.catalog.find(group, version, rest[0])
        if rt is None or (namespace is not None and not rt.namespaced):
            raise ApiError.not_found()
        name = rest[1] if len(rest) > 1 else None
        subresource = rest[2] if len(rest) > 2 else None
        if name is not None and rt.namespaced and namespace is None:
            raise ApiError.not_found()
        allowed = {"status"} if rt.status else set()
        allowed |= {"scale"} if rt.scale else set()
        if subresource is not None and subresource not in allowed:
            raise ApiError.not_found()
        return Target(rt, namespace, name, subresource)

    # ------------------------------------------------------------------ watching

    async def _watch(self, request: web.Request, target: Target) -> web.StreamResponse:
        query = request.query
        response = web.StreamResponse(status=200, headers={"Content-Type": JSON})
        response.enable_chunked_encoding()
        loop = asyncio.get_running_loop()
        try:
            timeout = float(query.get("timeoutSeconds") or 0)
        except ValueError:
            raise ApiError.bad_request(f"invalid timeoutSeconds {query['timeoutSeconds']!r}") from None
        deadline = loop.time() + timeout if timeout > 0 else None
        try:
            watch = self.store.watch(
                target.rt, target.namespace, name=target.name, since=query.get("resourceVersion"),
                label_selector=query.get("labelSelector"), field_selector=query.get("fieldSelector"),
                initial_events=query.get("sendInitialEvents") == "true", loop=loop)
        except ApiError as exc:
            if exc.code != 410:
                raise
            await response.prepare(request)  # a real server reports an expired start in-stream
            await _send(response, {"type": "ERROR", "object": exc.status()})
            return response
        as_table = _wants_table(request)  # kubectl get --watch: each event's object is a one-row Table
        include = query.get("includeObject", "PartialObjectMetadata")

        async def send(event: dict[str, Any]) -> None:
            if as_table and event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                obj = event["object"]
                event = {"type": event["type"],
                         "object": objects.table(target.rt, [obj], obj["metadata"]["resourceVersion"], include)}
            await _send(response, event)

        try:
            await response.prepare(request)
            for event in watch.initial:
                await send(event)
            if watch.bookmark is not None:
                await send(_bookmark(target.rt, watch.bookmark))
            for backlog in watch.backlog:
                if (out := watch.translate(backlog)) is not None:
                    await send(out)
            while (live := await self._next(request, watch, deadline)) is not None:
                await send(live)
        except ConnectionError:
            pass  # the client went away
        finally:
            watch.close()
        return response

    async def _next(self, request: web.Request, watch: Watch, deadline: float | None) -> dict[str, Any] | None:
        """The next event this watch must send; None when the stream should end (timeoutSeconds
        reached, the client gone, the server stopping)."""
        loop = asyncio.get_running_loop()
        while True:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return None
            try:
                event = await asyncio.wait_for(watch.queue.get(), min(IDLE_CHECK, left or IDLE_CHECK))
            except asyncio.TimeoutError:
                transport = request.transport
                if self.stopping.is_set() or transport is None or transport.is_closing():
                    return None
                continue
            if event is None:
                return None
            if (out := watch.translate(event)) is not None:
                return out


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(doc, separators=(",", ":")).encode(), status=status, content_type=JSON)


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")


async def _body(request: web.Request, required: bool = True) -> Any:
    content_type = request.headers.get("Content-Type", JSON).split(";")[0].strip()
    if "protobuf" in content_type or "cbor" in content_type:
        # kubectl's typed generators (create configmap, create deployment) send protobuf.
        if not required:
            return None
        raise ApiError(415, "UnsupportedMediaType", f"the emulator speaks JSON only, not {content_type}")
    raw = await request.read()
    if not raw:
        if required:
            raise ApiError.bad_request("the request has no body")
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ApiError.bad_request(f"the request body is not JSON: {exc}") from None


def _wants_table(request: web.Request) -> bool:
    return "as=Table" in request.headers.get("Accept", "")


def _bookmark(rt: ResourceType, rv: str) -> dict[str, Any]:
    return {"type": "BOOKMARK", "object": {
        "kind": rt.kind, "apiVersion": rt.api_version,
        "metadata": {"resourceVersion": rv, "annotations": {"k8s.io/initial-events-end": "true"}}}}
