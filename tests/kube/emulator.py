"""KubeEmulator: the API server on a free loopback port, in a background thread.

Tests start it, hand its kubeconfig to the code under test (a ``kopf run`` subprocess,
kubectl, the kubernetes client), and use the in-process accessors to look at what was
written and to play the parts of a cluster that are not emulated (the kubelet and the
controllers: ``patch_status`` a Deployment's ready replicas, for example).

Resources are named ``group/version/plural`` (``apps/v1/statefulsets``, ``v1/configmaps``,
``distbelief.io/v1alpha1/distbeliefjobs``) or, when unambiguous, by plural, kind or
short name (``configmaps``, ``Deployment``, ``dbj``). ``namespace`` is ignored for
cluster-scoped resources.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from .catalog import CRD_TYPE_KEY, Catalog, ResourceType, kopf_peering_crds
from .server import ApiServer, RequestRecord
from .store import ApiError, Store, Validator

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


class KubeEmulator:
    """An emulated Kubernetes API server.

    ``crds``: CustomResourceDefinition files or dicts, installed before the server starts
    (kopf's peering CRDs are always installed too). ``validators``: per resource key, a
    function that returns the object with its defaults applied or raises ValueError
    (with ``.errors`` lines ``field: rule``) -- the API server's structural-schema
    defaulting and validation, answered as 422 Invalid. ``history``: how many change
    events a watch can resume from before it gets 410 Gone.
    """

    def __init__(self, crds: Iterable[str | os.PathLike[str] | Mapping[str, Any]] = (),
                 validators: Mapping[str, Validator] | None = None, *, history: int = 10_000) -> None:
        self.store = Store(Catalog(), validators, history=history)
        self._server = ApiServer(self.store)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self.kubeconfig: Path | None = None
        for name in DEFAULT_NAMESPACES:
            self.create("v1/namespaces", {"metadata": {"name": name}})
        for crd in [*kopf_peering_crds(), *(_load_crd(c) for c in crds)]:
            self.create(CRD_TYPE_KEY, crd)

    # --------------------------------------------------------------- lifecycle

    def start(self) -> KubeEmulator:
        if self._thread is not None:
            raise RuntimeError("the emulator is already started")
        started = threading.Event()
        failure: list[BaseException] = []
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._listen())
            except BaseException as exc:  # reported to start()'s caller
                failure.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="kube-emulator", daemon=True)
        self._thread.start()
        if not started.wait(10) or failure:
            raise RuntimeError(f"the emulator did not start: {failure[0] if failure else 'timeout'}")
        return self

    async def _listen(self) -> None:
        self._runner = web.AppRunner(self._server.app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._port = self._runner.addresses[0][1]

    def stop(self) -> None:
        """End every watch, close the server and its thread. Safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self.store.close()

        async def shutdown() -> None:
            self._server.stopping.set()
            if self._runner is not None:
                await self._runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=15)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            if not thread.is_alive():
                loop.close()
            self._loop = self._thread = None

    def __enter__(self) -> KubeEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the emulator is not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: str | os.PathLike[str], namespace: str = "default") -> Path:
        """A kubeconfig for this server (plain http, a token user); also kept as ``.kubeconfig``."""
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulator-token"}}],
            "contexts": [{"name": "emulator",
                          "context": {"cluster": "emulator", "user": "tester", "namespace": namespace}}],
            "current-context": "emulator",
        }
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        self.kubeconfig = target
        return target

    def env(self, **extra: str) -> dict[str, str]:
        """``os.environ`` with KUBECONFIG pointing here: for subprocesses (kopf, kubectl)."""
        if self.kubeconfig is None:
            raise RuntimeError("write_kubeconfig() first")
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), **extra}

    @property
    def requests(self) -> list[RequestRecord]:
        """Every HTTP request answered so far (method, path, query, content type, code)."""
        return list(self._server.requests)

    # --------------------------------------------------------------- accessors

    def resource(self, resource: str) -> ResourceType:
        return self.store.catalog.resolve(resource)

    def get(self, resource: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        """The object, or None if there is none."""
        rt = self.resource(resource)
        return self.store.find(rt, namespace if rt.namespaced else None, name)

    def list(self, resource: str, namespace: str | None = None, *,
             labels: str | Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """Objects of a type, in one namespace or all (None), optionally by label selector."""
        if isinstance(labels, Mapping):
            labels = ",".join(f"{k}={v}" for k, v in labels.items())
        items, _ = self.store.list(self.resource(resource), namespace, labels)
        return items

    def create(self, resource: str, body: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """Create as a client would (validated, server metadata assigned, .status dropped for
        kinds with a status subresource: ``patch_status`` it after); the namespace defaults to
        the body's, then "default"."""
        rt = self.resource(resource)
        return self.store.create(rt, namespace if rt.namespaced else None, body)

    def patch(self, resource: str, name: str, patch: Any, namespace: str = "default", *,
              subresource: str | None = None, content_type: str = "application/merge-patch+json"
              ) -> dict[str, Any]:
        rt = self.resource(resource)
        return self.store.patch(rt, namespace if rt.namespaced else None, name, patch, content_type,
                                subresource=subresource)

    def patch_status(self, resource: str, name: str, status: Mapping[str, Any],
                     namespace: str = "default") -> dict[str, Any]:
        """Merge ``status`` into the object's .status through the status subresource (what
        the kubelet and the built-in controllers would write)."""
        rt = self.resource(resource)
        return self.store.patch(rt, namespace if rt.namespaced else None, name, {"status": dict(status)},
                                "application/merge-patch+json", subresource="status" if rt.status else None)

    def delete(self, resource: str, name: str, namespace: str = "default", *,
               propagation: str = "Background") -> dict[str, Any] | None:
        """Delete; the object if finalizers still hold it, None if it is gone."""
        rt = self.resource(resource)
        obj, gone = self.store.delete(rt, namespace if rt.namespaced else None, name, propagation=propagation)
        return None if gone else obj

    def wait_for(self, resource: str, name: str, namespace: str = "default",
                 condition: Callable[[dict[str, Any] | None], bool] = lambda obj: obj is not None,
                 timeout: float = 10.0) -> dict[str, Any] | None:
        """Block until ``condition(object or None)`` holds (by default: the object exists) and
        return the object; TimeoutError names the last state seen."""
        rt = self.resource(resource)
        ns = namespace if rt.namespaced else None
        last: list[dict[str, Any] | None] = [None]

        def done() -> bool:
            last[0] = self.store.find(rt, ns, name)
            return condition(last[0])

        with self.store.changed:
            if self.store.changed.wait_for(done, timeout=timeout):
                return last[0]
        raise TimeoutError(f"{rt.key} {ns + '/' if ns else ''}{name}: condition not met in {timeout}s; "
                           f"last seen: {last[0]!r}")


def _load_crd(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    docs = [d for d in yaml.safe_load_all(Path(source).read_text(encoding="utf-8")) if d]
    crds = [d for d in docs if d.get("kind") == "CustomResourceDefinition"]
    if len(crds) != 1:
        raise ValueError(f"{source}: expected one CustomResourceDefinition, found {len(crds)}")
    return crds[0]


__all__ = ["ApiError", "KubeEmulator", "RequestRecord"]
