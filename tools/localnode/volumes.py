"""A pod's volumes as folders of this machine, and its containers' mounts as paths into them.

    configMap, secret   the object's keys written out as files (the items the volume lists,
                        or all), a Secret's 0600 in a 0700 folder (localpods.write_secret)
    emptyDir            a folder of the pod's own, gone with the pod
    persistentVolumeClaim  the folder of the PersistentVolume bound to the claim (a local
                        or hostPath volume: what provisioner.py makes)
    hostPath            the path itself
    projected           a ServiceAccount token (TokenRequest, bound to the pod), configMap
                        items and the pod's name, namespace or uid (downwardAPI), as the
                        kubelet makes them for a pod's API access

The folders are written once, before the pod's first container starts (a kubelet would
also refresh ConfigMaps and Secrets later, and a token before it expires: a pod that runs
longer than its token's expirationSeconds loses the API here). A container reaches them only where its
command, args or environment name a mount path: mounts() tells the agent which local
folder stands for which mount path (localpods.local_path rewrites them).
"""

from __future__ import annotations

import base64
import os
from typing import Any, Mapping

from distbelief.operator import errors
from distbelief.operator.local import localpods
from localnode import api as node_api

Manifest = dict[str, Any]


def prepare(api: node_api.Api, pod: Manifest, folder: str) -> dict[str, str]:
    """Every volume of the pod made under folder (or found); volume name -> local folder."""
    made = {}
    for volume in pod["spec"].get("volumes") or []:
        target = os.path.join(folder, volume["name"])
        made[volume["name"]] = _make(api, pod, volume, target)
    return made


def mounts(container: Mapping[str, Any], volumes: Mapping[str, str]) -> dict[str, str]:
    """The container's mount paths -> local folders (subPath included)."""
    found = {}
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in volumes:
            raise errors.VolumeError(f"volumeMount {mount['mountPath']}: no volume named {mount['name']!r}")
        local = volumes[mount["name"]]
        found[mount["mountPath"]] = os.path.join(local, mount["subPath"]) if mount.get("subPath") else local
    return found


def _make(api: node_api.Api, pod: Manifest, volume: Mapping[str, Any], target: str) -> str:
    namespace = pod["metadata"]["namespace"]
    if "hostPath" in volume:
        os.makedirs(volume["hostPath"]["path"], exist_ok=True)
        return volume["hostPath"]["path"]
    if "persistentVolumeClaim" in volume:
        return _claim_folder(api, namespace, volume["persistentVolumeClaim"]["claimName"])
    os.makedirs(target, exist_ok=True)
    if "configMap" in volume:
        _write_config_map(api, namespace, volume["configMap"], target)
    elif "secret" in volume:
        _write_secret(api, namespace, volume["secret"], target)
    elif "projected" in volume:
        _write_projected(api, pod, volume["projected"], target)
    elif "emptyDir" not in volume:
        kinds = sorted(set(volume) - {"name"})
        raise errors.VolumeError(f"volume {volume['name']!r}: local-node does not make {', '.join(kinds)} volumes")
    return target


def _source(api: node_api.Api, namespace: str, plural: str, name: str, optional: bool) -> Manifest | None:
    found = api.get_path(node_api.path("v1", plural, namespace, name))
    if found is None and not optional:
        raise errors.VolumeError(f"{plural[:-1]} {namespace}/{name} not found")
    return found


def _write_config_map(api: node_api.Api, namespace: str, source: Mapping[str, Any], target: str) -> None:
    found = _source(api, namespace, "configmaps", source["name"], source.get("optional", False))
    data = {**(found or {}).get("data", {})}
    data.update({k: base64.b64decode(v).decode(errors="replace")
                 for k, v in (found or {}).get("binaryData", {}).items()})
    for item in _items(source, data):
        path = os.path.join(target, item["path"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(data[item["key"]])


def _write_secret(api: node_api.Api, namespace: str, source: Mapping[str, Any], target: str) -> None:
    found = _source(api, namespace, "secrets", source["secretName"], source.get("optional", False))
    data = (found or {}).get("data") or {}
    localpods.write_secret(target, {"data": data}, _items(source, data))


POD_FIELDS = ("metadata.name", "metadata.namespace", "metadata.uid")


def _write_projected(api: node_api.Api, pod: Manifest, projected: Mapping[str, Any], target: str) -> None:
    files: dict[str, str] = {}
    for source in projected.get("sources") or []:
        if "serviceAccountToken" in source:
            files[source["serviceAccountToken"]["path"]] = _token(api, pod, source["serviceAccountToken"])
        elif "configMap" in source:
            config_map = source["configMap"]
            found = _source(api, pod["metadata"]["namespace"], "configmaps", config_map["name"],
                            config_map.get("optional", False))
            data = (found or {}).get("data") or {}
            files.update({item["path"]: data[item["key"]] for item in _items(config_map, data)})
        elif "downwardAPI" in source:
            files.update({item["path"]: _pod_field(pod, item) for item in source["downwardAPI"]["items"]})
        else:
            raise errors.VolumeError(f"projected source {sorted(source)}: local-node makes serviceAccountToken, "
                                     "configMap and downwardAPI sources")
    for name, text in files.items():
        path = os.path.join(target, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(path, projected.get("defaultMode", 0o644) & 0o777)


def _token(api: node_api.Api, pod: Manifest, source: Mapping[str, Any]) -> str:
    """A token of the pod's ServiceAccount bound to the pod (it dies with it), by TokenRequest."""
    meta, account = pod["metadata"], pod["spec"].get("serviceAccountName") or "default"
    spec: Manifest = {"expirationSeconds": int(source.get("expirationSeconds", 3600)),
                      "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}
    if source.get("audience"):
        spec["audiences"] = [source["audience"]]
    where = node_api.path("v1", "serviceaccounts", meta["namespace"], account, subresource="token")
    answer = api.create_path(where, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
    token = ((answer or {}).get("status") or {}).get("token")
    if not token:
        raise errors.VolumeError(f"no token for serviceaccount {meta['namespace']}/{account}")
    return str(token)


def _pod_field(pod: Manifest, item: Mapping[str, Any]) -> str:
    path = (item.get("fieldRef") or {}).get("fieldPath", "")
    if path not in POD_FIELDS:
        raise errors.VolumeError(f"downwardAPI item {item.get('path')!r}: local-node fills {', '.join(POD_FIELDS)}")
    return str(pod["metadata"][path.split(".", 1)[1]])


def _items(source: Mapping[str, Any], data: Mapping[str, Any]) -> list[Mapping[str, str]]:
    items = source.get("items") or [{"key": key, "path": key} for key in data]
    missing = [item["key"] for item in items if item["key"] not in data]
    if missing:
        raise errors.VolumeError(f"volume keys not found: {', '.join(missing)}")
    return items


def _claim_folder(api: node_api.Api, namespace: str, claim: str) -> str:
    found = api.get_path(node_api.path("v1", "persistentvolumeclaims", namespace, claim))
    volume_name = ((found or {}).get("spec") or {}).get("volumeName")
    if not volume_name:
        raise errors.VolumeError(f"persistentvolumeclaim {namespace}/{claim} is not bound")
    volume = api.get_path(node_api.path("v1", "persistentvolumes", name=volume_name)) or {}
    spec = volume.get("spec") or {}
    local = (spec.get("local") or spec.get("hostPath") or {}).get("path")
    if not local:
        raise errors.VolumeError(f"persistentvolume {volume_name} is neither local nor hostPath")
    os.makedirs(local, exist_ok=True)
    return local
