"""Every kind of API object the operator process touches, in one table.

A row says what the operator does to the kind (its verbs, and its subresources' verbs),
whether it is a child of a job (rendered and applied; watched and put back when it
drifts) and whether the spec may stop asking for it (then it is deleted again). The API
client's paths, the children's watches, the removal of optional children and the chart's
RBAC derive from it: tests/unit/test_kinds_rbac.py checks that the chart grants every
verb the table implies, and nothing the table does not name.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from distbelief.runtime import contract

# What applying a child takes (kube.Kube.apply: read, create when missing, patch), and
# watching one (kopf lists, then watches).
APPLY = frozenset({"get", "create", "patch"})
WATCH = frozenset({"list", "watch"})


@dataclasses.dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    verbs: frozenset[str]
    subresources: tuple[tuple[str, frozenset[str]], ...] = ()
    # A child of a job that the operator watches and puts back when it drifts.
    watched_child: bool = False
    # A child the spec may stop asking for: the name of the job's one (then it is deleted).
    optional_name: Callable[[contract.JobNames], str] | None = None
    # Granted in the ClusterRole whatever namespaces the operator watches.
    cluster_wide: bool = False

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]


def _child(api_version: str, kind: str, plural: str, *,
           optional_name: Callable[[contract.JobNames], str] | None = None) -> Kind:
    verbs = APPLY | WATCH | ({"delete"} if optional_name else set())
    return Kind(api_version, kind, plural, frozenset(verbs), watched_child=True, optional_name=optional_name)


def _kind(api_version: str, kind: str, plural: str, *verbs: str,
          subresources: tuple[tuple[str, frozenset[str]], ...] = (), cluster_wide: bool = False) -> Kind:
    return Kind(api_version, kind, plural, frozenset(verbs), subresources, cluster_wide=cluster_wide)


KINDS = (
    # The job: kopf watches it, keeps its progress in annotations and writes its status; the
    # operator reads it afresh when a child changed and deletes it after its TTL. Children's
    # owner references block the owner's deletion, which some admission plugins admit only
    # from a client that may update the owner's finalizers.
    _kind(contract.JOB_API_VERSION, contract.KIND, contract.PLURAL, "get", "list", "watch", "patch", "delete",
          subresources=(("status", frozenset({"patch"})), ("finalizers", frozenset({"update"})))),
    _child("v1", "ConfigMap", "configmaps"),
    _child("v1", "Service", "services"),
    _child("apps/v1", "StatefulSet", "statefulsets"),
    _child("apps/v1", "Deployment", "deployments"),
    _child("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    _child("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers",
           optional_name=lambda names: names.worker),
    _child("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies", optional_name=lambda names: names.ps),
    # With backups: the shard pods' identity and the role that lets it keep their view
    # Leases. Applied, not watched.
    _kind("v1", "ServiceAccount", "serviceaccounts", *APPLY),
    _kind("rbac.authorization.k8s.io/v1", "Role", "roles", *APPLY),
    _kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings", *APPLY),
    # Never called by the operator: a Role may grant only what its maker holds.
    _kind("coordination.k8s.io/v1", "Lease", "leases", "get", "create", "update"),
    # The job's key Secret: created once, never read (its uid is kept in the job).
    _kind("v1", "Secret", "secrets", "create"),
    # Checkpoint claims an earlier job of the same name left, and the claims of a reshard's
    # new shard pods (made before the pods); the jobs' pods, watched for their status
    # (cluster/observing.py).
    _kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims", "list", "create"),
    # A reshard's Job (render/reshardjob.py): read while it runs, deleted once followed.
    _kind("batch/v1", "Job", "jobs", "get", "create", "delete"),
    _kind("v1", "Pod", "pods", *WATCH),
    _kind("v1", "Event", "events", "create"),
    # A queued job's Kueue Workload, and the flavors its admission assigns.
    _kind("kueue.x-k8s.io/v1beta1", "Workload", "workloads", "get", "create", "delete",
          subresources=(("status", frozenset({"patch"})),)),
    _kind("kueue.x-k8s.io/v1beta1", "ResourceFlavor", "resourceflavors", "get", cluster_wide=True),
    # kopf itself: the custom resource types appearing, the namespaces of a list of them,
    # and its peering objects.
    _kind("apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", "list", "watch",
          cluster_wide=True),
    _kind("v1", "Namespace", "namespaces", "list", "watch", cluster_wide=True),
    _kind("kopf.dev/v1", "KopfPeering", "kopfpeerings", "list", "watch", "patch"),
    _kind("kopf.dev/v1", "ClusterKopfPeering", "clusterkopfpeerings", "list", "watch", "patch"),
)

# apiVersion/kind -> plural, for the API client's paths.
PLURALS = {(k.api_version, k.kind): k.plural for k in KINDS}
# (group/version, plural) of every child the operator watches and puts back.
WATCHED_CHILDREN = tuple((k.api_version, k.plural) for k in KINDS if k.watched_child)
# (apiVersion, kind) -> the name of the job's one, for children the spec may stop asking for.
OPTIONAL = {(k.api_version, k.kind): k.optional_name for k in KINDS if k.optional_name}
