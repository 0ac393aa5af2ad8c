"""The resource types the emulator serves, and the discovery documents built from them.

Built-in types are listed here once (group, version, plural, kind, scope, short names,
which subresources they have); custom types come from CustomResourceDefinition
documents, exactly as the API server derives them: names, scope, the status and scale
subresources and the printer columns of every served version.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
SUBRESOURCE_VERBS = ("get", "patch", "update")


@dataclasses.dataclass(frozen=True)
class ScalePaths:
    """Where a type keeps what its ``/scale`` subresource shows (paths as key tuples).

    ``selector`` points either at a label-selector string (custom resources, the CRD's
    ``labelSelectorPath``) or, when ``selector_is_object``, at a LabelSelector object
    (Deployments, StatefulSets: ``.spec.selector``), which is rendered as a string.
    """

    spec_replicas: tuple[str, ...]
    status_replicas: tuple[str, ...]
    selector: tuple[str, ...] | None = None
    selector_is_object: bool = False


@dataclasses.dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    singular: str = ""
    status: bool = False            # has /status: the main endpoint ignores .status changes
    scale: ScalePaths | None = None  # has /scale
    columns: tuple[Mapping[str, Any], ...] = ()  # additionalPrinterColumns (custom types)
    custom: bool = False            # served because a CRD says so
    verbs: tuple[str, ...] = ALL_VERBS

    @property
    def key(self) -> str:
        """``group/version/plural``, or ``v1/plural`` for the core group."""
        return f"{self.api_version}/{self.plural}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """How the API server names the type in messages: ``plural.group`` or ``plural``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def singular_name(self) -> str:
        return self.singular or self.kind.lower()

    def discovery(self) -> list[dict[str, Any]]:
        """This type's entries in its APIResourceList (the resource and its subresources)."""
        entries = [{
            "name": self.plural, "singularName": self.singular_name, "namespaced": self.namespaced,
            "kind": self.kind, "verbs": list(self.verbs),
            **({"shortNames": list(self.short_names)} if self.short_names else {}),
            **({"categories": list(self.categories)} if self.categories else {}),
        }]
        if self.status:
            entries.append({"name": f"{self.plural}/status", "singularName": "", "namespaced": self.namespaced,
                            "kind": self.kind, "verbs": list(SUBRESOURCE_VERBS)})
        if self.scale:
            # kubectl scale finds the Scale kind it must send from these three fields.
            entries.append({"name": f"{self.plural}/scale", "singularName": "", "namespaced": self.namespaced,
                            "group": "autoscaling", "version": "v1", "kind": "Scale",
                            "verbs": list(SUBRESOURCE_VERBS)})
        return entries


_WORKLOAD_SCALE = ScalePaths(("spec", "replicas"), ("status", "replicas"), ("spec", "selector"),
                             selector_is_object=True)

BUILTINS: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "namespaces", "Namespace", namespaced=False, short_names=("ns",), status=True,
                 verbs=("create", "delete", "get", "list", "patch", "update", "watch")),
    ResourceType("", "v1", "configmaps", "ConfigMap", short_names=("cm",)),
    ResourceType("", "v1", "secrets", "Secret"),
    ResourceType("", "v1", "services", "Service", short_names=("svc",), categories=("all",), status=True),
    ResourceType("", "v1", "pods", "Pod", short_names=("po",), categories=("all",), status=True),
    ResourceType("", "v1", "events", "Event", short_names=("ev",)),
    ResourceType("", "v1", "serviceaccounts", "ServiceAccount", short_names=("sa",)),
    ResourceType("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short_names=("pvc",), status=True),
    ResourceType("apps", "v1", "statefulsets", "StatefulSet", short_names=("sts",), categories=("all",),
                 status=True, scale=_WORKLOAD_SCALE),
    ResourceType("apps", "v1", "deployments", "Deployment", short_names=("deploy",), categories=("all",),
                 status=True, scale=_WORKLOAD_SCALE),
    ResourceType("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler",
                 short_names=("hpa",), categories=("all",), status=True),
    ResourceType("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short_names=("netpol",)),
    ResourceType("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short_names=("pdb",), status=True),
    ResourceType("events.k8s.io", "v1", "events", "Event", short_names=("ev",)),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease"),
    ResourceType("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    ResourceType("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    ResourceType("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
                 namespaced=False, short_names=("crd", "crds"), status=True),
)

CRD_TYPE_KEY = "apiextensions.k8s.io/v1/customresourcedefinitions"


def kopf_peering_crds() -> list[dict[str, Any]]:
    """kopf's own CRDs (KopfPeering, ClusterKopfPeering), as a cluster with kopf installed has them."""
    def crd(plural: str, kind: str, scope: str) -> dict[str, Any]:
        return {
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.kopf.dev"},
            "spec": {
                "group": "kopf.dev", "scope": scope,
                "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
                "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                    "type": "object", "properties": {"status": {
                        "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}],
            },
        }
    return [crd("kopfpeerings", "KopfPeering", "Namespaced"),
            crd("clusterkopfpeerings", "ClusterKopfPeering", "Cluster")]


def types_of_crd(crd: Mapping[str, Any]) -> list[ResourceType]:
    """The resource types one CRD serves: one per served version."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    result = []
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        subresources = version.get("subresources") or {}
        scale = subresources.get("scale")
        result.append(ResourceType(
            group=spec["group"], version=version["name"], plural=names["plural"], kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            short_names=tuple(names.get("shortNames") or ()), categories=tuple(names.get("categories") or ()),
            singular=names.get("singular") or "",
            status="status" in subresources,
            scale=ScalePaths(
                spec_replicas=json_path(scale["specReplicasPath"]),
                status_replicas=json_path(scale["statusReplicasPath"]),
                selector=json_path(scale["labelSelectorPath"]) if scale.get("labelSelectorPath") else None,
            ) if scale else None,
            columns=tuple(version.get("additionalPrinterColumns") or ()),
            custom=True,
        ))
    return result


def json_path(path: str) -> tuple[str, ...]:
    """``.spec.workers.replicas`` -> ``("spec", "workers", "replicas")`` (the simple paths CRDs use)."""
    if not path.startswith(".") or "[" in path:
        raise ValueError(f"unsupported JSON path {path!r}: only .dotted.paths")
    return tuple(path[1:].split("."))


class Catalog:
    """The set of served types; CRDs add and remove theirs while the server runs."""

    def __init__(self, builtins: Iterable[ResourceType] = BUILTINS) -> None:
        self._lock = threading.Lock()
        self._types: dict[str, ResourceType] = {t.key: t for t in builtins}

    def add(self, types: Iterable[ResourceType]) -> None:
        with self._lock:
            self._types.update((t.key, t) for t in types)

    def remove(self, types: Iterable[ResourceType]) -> None:
        with self._lock:
            for t in types:
                self._types.pop(t.key, None)

    def __iter__(self) -> Iterator[ResourceType]:
        with self._lock:
            return iter(list(self._types.values()))

    def find(self, group: str, version: str, plural: str) -> ResourceType | None:
        with self._lock:
            return self._types.get(f"{group}/{version}/{plural}" if group else f"{version}/{plural}")

    def resolve(self, name: str) -> ResourceType:
        """A type by key (``apps/v1/deployments``, ``v1/configmaps``) or, when unambiguous, by
        plural, singular, kind or short name (``deployments``, ``dbj``, ``ConfigMap``)."""
        with self._lock:
            if name in self._types:
                return self._types[name]
            matches = {t.key: t for t in self._types.values()
                       if name in (t.plural, t.singular_name, t.kind, t.kind.lower(), *t.short_names)}
        if len(matches) == 1:
            return next(iter(matches.values()))
        if not matches:
            raise KeyError(f"unknown resource {name!r}")
        # Prefer the core group when a name is served twice (events: v1 and events.k8s.io/v1).
        core = [t for t in matches.values() if t.group == ""]
        if len(core) == 1:
            return core[0]
        raise KeyError(f"ambiguous resource {name!r}: {', '.join(sorted(matches))}")

    # ------------------------------------------------------------- discovery documents

    def _groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for t in self:
            if t.group and t.version not in groups.setdefault(t.group, []):
                groups[t.group].append(t.version)
        return groups

    @staticmethod
    def _group_doc(name: str, versions: list[str]) -> dict[str, Any]:
        entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
        return {"name": name, "versions": entries, "preferredVersion": entries[0]}

    def api_versions(self) -> dict[str, Any]:
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}

    def api_group_list(self) -> dict[str, Any]:
        return {"kind": "APIGroupList", "apiVersion": "v1",
                "groups": [self._group_doc(g, vs) for g, vs in sorted(self._groups().items())]}

    def api_group(self, group: str) -> dict[str, Any] | None:
        versions = self._groups().get(group)
        if not versions:
            return None
        return {"kind": "APIGroup", "apiVersion": "v1", **self._group_doc(group, versions)}

    def api_resource_list(self, group: str, version: str) -> dict[str, Any] | None:
        types = [t for t in self if t.group == group and t.version == version]
        if not types:
            return None
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version,
                "resources": [entry for t in types for entry in t.discovery()]}
