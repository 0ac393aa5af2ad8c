"""A small client of the Kubernetes API over the standard library (urllib and ssl), for
what a shard copy asks of it: its shard's view Lease (kubelease.py). The runtime never
imports the kubernetes client (shard pods need numpy and pyzmq only).

    KubeApi.in_cluster()   the pod's own credentials: the ServiceAccount token, the
                           cluster's CA and the namespace in $DISTBELIEF_SERVICE_ACCOUNT_DIR
                           (default: where Kubernetes mounts a pod's token), the API
                           server at $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    api.call(method, path, body) -> (HTTP status, JSON body or None)

The token file is read again every TOKEN_REREAD_SECONDS: the kubelet rotates bound tokens
in place. Nothing here retries; a request that does not complete raises StoreUnavailable.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from typing import Any, Mapping

from distbelief.runtime import contract, errors
from distbelief.runtime.shard.copies.viewstore import StoreUnavailable

TOKEN_REREAD_SECONDS = 60.0
REQUEST_SECONDS = 5.0


class KubeApi:
    def __init__(self, server: str, *, token: str | None = None, token_file: str | None = None,
                 ca_file: str | None = None, timeout: float = REQUEST_SECONDS) -> None:
        self.server, self.timeout = server.rstrip("/"), timeout
        self._token, self._token_file, self._token_read = token, token_file, 0.0
        self._context = ssl.create_default_context(cafile=ca_file) if server.startswith("https") else None

    @classmethod
    def in_cluster(cls, root: str | None = None, environ: Mapping[str, str] = os.environ) -> tuple[KubeApi, str]:
        """The pod's API client and its namespace; ConfigError when it runs outside a cluster
        or without its ServiceAccount's token mounted. root: the token's folder."""
        root = root or environ.get(contract.ENV_SERVICE_ACCOUNT_DIR) or contract.SERVICE_ACCOUNT_DIR
        host, port = environ.get("KUBERNETES_SERVICE_HOST", ""), environ.get("KUBERNETES_SERVICE_PORT", "443")
        token, ca, namespace = (os.path.join(root, name) for name in ("token", "ca.crt", "namespace"))
        if not host:
            raise errors.ConfigError("no KUBERNETES_SERVICE_HOST: not in a cluster (local mode sets "
                                     "DISTBELIEF_VIEW_STORE=file:FOLDER)")
        if not os.path.exists(token):
            raise errors.ConfigError(f"no ServiceAccount token at {token}: a shard with backups keeps its view in a "
                                     "Lease, and needs its pod's token mounted")
        try:
            with open(namespace, encoding="utf-8") as f:
                own_namespace = f.read().strip()
        except OSError as exc:
            raise errors.ConfigError(f"cannot read the pod's namespace from {namespace}: {exc}") from exc
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return cls(server, token_file=token, ca_file=ca if os.path.exists(ca) else None), own_namespace

    def token(self) -> str:
        if self._token_file and time.monotonic() - self._token_read > TOKEN_REREAD_SECONDS:
            try:
                with open(self._token_file, encoding="utf-8") as f:
                    self._token = f.read().strip()
            except OSError as exc:
                raise StoreUnavailable(f"cannot read the ServiceAccount token {self._token_file}: {exc}") from exc
            self._token_read = time.monotonic()
        return self._token or ""

    def account(self) -> tuple[str, str] | None:
        """(name, uid) of the ServiceAccount the token is of, from its JWT claims, if they say."""
        try:
            claims = json.loads(_unpadded_b64(self.token().split(".")[1]))
        except (IndexError, ValueError, StoreUnavailable):
            return None
        bound = (claims.get("kubernetes.io") or {}).get("serviceaccount") or {}
        name = bound.get("name") or claims.get("kubernetes.io/serviceaccount/service-account.name")
        uid = bound.get("uid") or claims.get("kubernetes.io/serviceaccount/service-account.uid")
        return (str(name), str(uid)) if name and uid else None

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One request; (status, parsed body). StoreUnavailable if it does not complete."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Accept": "application/json", "Content-Type": "application/json",
            "Authorization": f"Bearer {self.token()}"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self._context) as response:
                return response.status, _json(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json(exc.read())
        except (OSError, ValueError) as exc:  # refused, reset, timed out, TLS
            raise StoreUnavailable(f"{method} {self.server}{path}: {exc}") from exc


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return {"message": raw[:200].decode(errors="replace")}


def _unpadded_b64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def message(body: Any) -> str:
    """The API server's reason, from an error body."""
    return str(body.get("message", "")) if isinstance(body, dict) else ""
