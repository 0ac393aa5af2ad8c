"""A local-path provisioner: a folder of this machine for every volume claim the agent may
serve, as a PersistentVolume bound to the claim.

A claim is served when it is unbound and names no storage class (the cluster has no
default one) or a class whose provisioner is PROVISIONER, and no other node was selected
for it. Its volume, `pvc-<claim uid>`, is a `local` volume at ROOT/volumes/<name> with
node affinity to this node (so the scheduler puts the claim's pods here), made with the
claim's size and access modes and pre-bound to the claim: the controller manager's volume
binder completes the binding, and then the scheduler binds the pods that wait for it (a
StatefulSet's shards). A volume released by its claim's deletion is deleted with its
folder when its reclaim policy is Delete (the default); Retain keeps both.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Mapping

from localnode import api as node_api

log = logging.getLogger(__name__)

PROVISIONER = "distbelief.io/local-node"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
SELECTED_NODE = "volume.kubernetes.io/selected-node"
HOSTNAME_LABEL = "kubernetes.io/hostname"
Manifest = dict[str, Any]


class Provisioner:
    def __init__(self, api: node_api.Api, node: str, root: str) -> None:
        self.api, self.node, self.root = api, node, root

    def sync(self) -> None:
        claims = self.api.list_path(node_api.path("v1", "persistentvolumeclaims"))
        classes: dict[str, Manifest] | None = None
        for claim in claims:
            spec = claim.get("spec") or {}
            if spec.get("volumeName") or claim["metadata"].get("deletionTimestamp"):
                continue
            selected = (claim["metadata"].get("annotations") or {}).get(SELECTED_NODE)
            if selected and selected != self.node:
                continue
            wanted = spec.get("storageClassName") or ""
            if wanted:
                classes = self._classes() if classes is None else classes
                if classes.get(wanted, {}).get("provisioner") != PROVISIONER:
                    continue
            self._provision(claim, (classes or {}).get(wanted, {}))
        for volume in self.api.list_path(node_api.path("v1", "persistentvolumes")):
            if self._released(volume):
                self._delete(volume)

    def folder(self, volume: str) -> str:
        return os.path.join(self.root, "volumes", volume)

    def _classes(self) -> dict[str, Manifest]:
        return {c["metadata"]["name"]: c for c in self.api.list_path(node_api.path("storage.k8s.io/v1",
                                                                                   "storageclasses"))}

    def _provision(self, claim: Manifest, storage_class: Mapping[str, Any]) -> None:
        meta, spec = claim["metadata"], claim["spec"]
        name = f"pvc-{meta['uid']}"
        folder = self.folder(name)
        os.makedirs(folder, exist_ok=True)
        affinity = {"required": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "In", "values": [self.node]}]}]}}
        volume = {
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": name, "annotations": {PROVISIONED_BY: PROVISIONER}},
            "spec": {"capacity": {"storage": spec["resources"]["requests"]["storage"]},
                     "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                     "volumeMode": spec.get("volumeMode", "Filesystem"),
                     "persistentVolumeReclaimPolicy": storage_class.get("reclaimPolicy", "Delete"),
                     "storageClassName": spec.get("storageClassName") or "",
                     "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"],
                                  "name": meta["name"], "uid": meta["uid"]},
                     "local": {"path": folder}, "nodeAffinity": affinity}}
        if self.api.create_path(node_api.path("v1", "persistentvolumes"), volume) is not None:
            log.info("event=volume_provisioned volume=%s claim=%s/%s folder=%s", name, meta["namespace"],
                     meta["name"], folder)

    def _released(self, volume: Manifest) -> bool:
        meta, spec = volume["metadata"], volume.get("spec") or {}
        ours = (meta.get("annotations") or {}).get(PROVISIONED_BY) == PROVISIONER \
            and (spec.get("local") or {}).get("path") == self.folder(meta["name"])
        return ours and (volume.get("status") or {}).get("phase") == "Released" \
            and spec.get("persistentVolumeReclaimPolicy") == "Delete"

    def _delete(self, volume: Manifest) -> None:
        name = volume["metadata"]["name"]
        shutil.rmtree(self.folder(name), ignore_errors=True)
        if self.api.delete_path(node_api.path("v1", "persistentvolumes", name=name)):
            log.info("event=volume_deleted volume=%s", name)
