"""A container of a pod as the command line and environment of a local process.

The environment is what a kubelet gives: the container's env (values, the downward API's
fieldRef and resourceFieldRef, ConfigMap and Secret keys) and envFrom, with $(VAR)
references expanded, over this machine's environment (PATH, the Python of the agent),
less the agent's own credentials (KUBECONFIG), and the API server's address as
KUBERNETES_SERVICE_HOST and _PORT (the server itself: there is no Service proxy here). The command is the container's command
and args, $(VAR) expanded; without a command, the image's entry point when the agent
knows it (the project's image: `distbelief`). Mount paths in them are rewritten to the
volumes' local folders, and the termination message path to a file of the pod's own, as
local mode does (localpods). DistBelief's roles get the pod network's addresses (roles.py).
"""

from __future__ import annotations

import base64
import os
import re
import urllib.parse
from typing import Any, Callable, Mapping

from distbelief.operator import errors
from distbelief.operator.local import localpods
from distbelief.operator.render import podparts
from localnode import api as node_api

Manifest = dict[str, Any]
TERMINATION_LOG = "/dev/termination-log"
# Entry points of images the agent knows, by the last part of the image's repository.
ENTRYPOINTS = {"distbelief": ["distbelief"]}
HIDDEN_ENV = ("KUBECONFIG",)
_REFERENCE = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """$(VAR) replaced by env's VAR when defined (left as written otherwise); $$ is a $."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _REFERENCE.sub(one, text)


def entrypoint(container: Mapping[str, Any]) -> list[str]:
    if container.get("command"):
        return list(container["command"])
    image = container.get("image", "")
    repository = image.split("@")[0].rsplit("/", 1)[-1].split(":")[0]
    if repository in ENTRYPOINTS:
        return ENTRYPOINTS[repository]
    raise errors.ContainerConfigError(f"container {container['name']} has no command, and local-node does not know the "
                               f"entry point of image {image!r}")


def argv(container: Mapping[str, Any], env: Mapping[str, str], local: Callable[[str], str]) -> list[str]:
    """The process's command line: entry point and args, $(VAR) expanded, local paths.

    Only the container's own words are made local: the interpreter that stands for the
    image's entry point may itself live under a path the pod mounts (a clone under /tmp).
    """
    words = [local(expand(w, env)) for w in entrypoint(container) + list(container.get("args") or [])]
    return localpods.local_command(words[:1]) + words[1:]


def localizer(mounts: Mapping[str, str], termination_file: str, termination_path: str) -> Callable[[str], str]:
    """A word with mount paths and the termination message path made local."""
    def local(word: str) -> str:
        return localpods.local_path(word, mounts).replace(termination_path, termination_file)
    return local


def environment(api: node_api.Api, pod: Manifest, container: Mapping[str, Any], fields: Mapping[str, str],
                capacity: Mapping[str, str], local: Callable[[str], str]) -> dict[str, str]:
    """The process's environment (see the module's docstring)."""
    namespace = pod["metadata"]["namespace"]
    own: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        own.update(_env_from(api, namespace, source))
    for item in container.get("env") or []:
        value = item.get("value")
        if value is not None:
            own[item["name"]] = expand(str(value), own)
        else:
            found = _value_from(api, pod, container, item["valueFrom"], fields, capacity)
            if found is not None:
                own[item["name"]] = found
    base = {k: v for k, v in os.environ.items() if k not in HIDDEN_ENV}
    return {**base, **_api_server(api.server), "PYTHONUNBUFFERED": "1",
            "HOSTNAME": pod["spec"].get("hostname") or pod["metadata"]["name"], **{k: local(v) for k, v in own.items()}}


def _api_server(server: str) -> dict[str, str]:
    url = urllib.parse.urlsplit(server)
    return {"KUBERNETES_SERVICE_HOST": url.hostname or "", "KUBERNETES_SERVICE_PORT": str(url.port or 443)}


def downward_fields(pod: Manifest, pod_ip: str, host_ip: str) -> dict[str, str]:
    meta, spec = pod["metadata"], pod["spec"]
    fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
              "spec.nodeName": spec.get("nodeName", ""), "spec.serviceAccountName": spec.get("serviceAccountName", ""),
              "status.podIP": pod_ip, "status.podIPs": pod_ip, "status.hostIP": host_ip, "status.hostIPs": host_ip}
    for kind in ("labels", "annotations"):
        fields.update({f"metadata.{kind}['{k}']": v for k, v in (meta.get(kind) or {}).items()})
    return fields


def _value_from(api: node_api.Api, pod: Manifest, container: Mapping[str, Any], source: Mapping[str, Any],
                fields: Mapping[str, str], capacity: Mapping[str, str]) -> str | None:
    namespace = pod["metadata"]["namespace"]
    if "fieldRef" in source:
        path = source["fieldRef"]["fieldPath"]
        if path not in fields and not re.match(r"metadata\.(labels|annotations)\[", path):
            raise errors.ContainerConfigError(f"env fieldRef {path!r} is not one local-node fills")
        return fields.get(path, "")
    if "resourceFieldRef" in source:
        return _resource_field(container, source["resourceFieldRef"], capacity)
    for kind, plural in (("configMapKeyRef", "configmaps"), ("secretKeyRef", "secrets")):
        if kind in source:
            ref = source[kind]
            data = _object_data(api, namespace, plural, ref["name"], ref.get("optional", False))
            if ref["key"] not in data:
                if ref.get("optional"):
                    return None
                raise errors.ContainerConfigError(f"{plural[:-1]} {namespace}/{ref['name']} has no key {ref['key']!r}")
            return data[ref["key"]]
    raise errors.ContainerConfigError(f"env valueFrom {sorted(source)} is not one local-node fills")


def _resource_field(container: Mapping[str, Any], ref: Mapping[str, Any], capacity: Mapping[str, str]) -> str:
    kind, _, resource = ref["resource"].partition(".")
    quantity = ((container.get("resources") or {}).get(kind) or {}).get(resource) or capacity.get(resource, "0")
    value = podparts.cpu_cores(quantity) / podparts.cpu_cores(ref.get("divisor", "1"))
    return str(int(-(-value // 1)))  # rounded up, as a kubelet does


def _env_from(api: node_api.Api, namespace: str, source: Mapping[str, Any]) -> dict[str, str]:
    prefix = source.get("prefix", "")
    for kind, plural in (("configMapRef", "configmaps"), ("secretRef", "secrets")):
        if kind in source:
            ref = source[kind]
            data = _object_data(api, namespace, plural, ref["name"], ref.get("optional", False))
            return {prefix + k: v for k, v in data.items()}
    return {}


def _object_data(api: node_api.Api, namespace: str, plural: str, name: str, optional: bool) -> dict[str, str]:
    found = api.get_path(node_api.path("v1", plural, namespace, name))
    if found is None:
        if optional:
            return {}
        raise errors.ContainerConfigError(f"{plural[:-1]} {namespace}/{name} not found")
    data = found.get("data") or {}
    if plural == "secrets":
        return {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
    return dict(data)
