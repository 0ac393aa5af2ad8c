"""A role's template (spec.parameterServers.template, spec.workers.template) and the
job-wide spec.imagePullSecrets, merged onto the pod template the renderer built.

Pure functions. The validator (validation/templates.py) has already refused whatever the
operator owns, so the merge only adds: labels, annotations and the node selector are
merged key by key, lists (tolerations, spread constraints, pull secrets, volumes, env,
mounts) are appended to the operator's, affinity terms are added to its own, and the
scalar fields (priorityClassName, serviceAccountName, schedulerName) are set.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

Manifest = dict[str, Any]

APPENDED = ("tolerations", "topologySpreadConstraints", "volumes")
SET = ("priorityClassName", "serviceAccountName", "schedulerName")


def apply_template(pod_template: Manifest, template: Mapping[str, Any] | None,
                   pull_secrets: Sequence[Mapping[str, Any]] | None = None) -> Manifest:
    """pod_template with template and the job-wide pull secrets merged onto it (a new dict)."""
    merged = copy.deepcopy(pod_template)
    template = copy.deepcopy(dict(template or {}))
    meta, spec = template.get("metadata") or {}, template.get("spec") or {}
    for key in ("labels", "annotations"):
        if meta.get(key):
            merged["metadata"].setdefault(key, {}).update(meta[key])
    pod = merged["spec"]
    if spec.get("nodeSelector"):
        pod["nodeSelector"] = {**pod.get("nodeSelector", {}), **spec["nodeSelector"]}
    for key in APPENDED:
        if spec.get(key):
            pod[key] = [*pod.get(key, []), *spec[key]]
    for key in SET:
        if spec.get(key):
            pod[key] = spec[key]
    secrets = _unique_names([*(pull_secrets or []), *(spec.get("imagePullSecrets") or [])])
    if secrets:
        pod["imagePullSecrets"] = secrets
    if spec.get("affinity"):
        pod["affinity"] = merge_affinity(pod.get("affinity") or {}, spec["affinity"])
    for extra in spec.get("containers") or []:
        container = pod["containers"][0]
        for key in ("env", "volumeMounts"):
            if extra.get(key):
                container[key] = [*container.get(key, []), *extra[key]]
    return merged


def add_placement(pod_template: Manifest, node_selector: Mapping[str, str],
                  tolerations: list[Mapping[str, Any]]) -> Manifest:
    """pod_template with a node selector and tolerations added (a queue's admission)."""
    return apply_template(pod_template, {"spec": {"nodeSelector": dict(node_selector),
                                                  "tolerations": list(tolerations)}})


def merge_affinity(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> Manifest:
    """Both affinities' terms: for each kind (nodeAffinity, podAffinity, podAntiAffinity) and
    each rule list in it, ours then theirs; the operator sets no required node affinity, so
    a user's is taken as it is."""
    merged = copy.deepcopy(dict(ours))
    for kind, rules in theirs.items():
        target = merged.setdefault(kind, {})
        for rule, value in rules.items():
            target[rule] = [*target.get(rule, []), *value] if isinstance(value, list) else value
    return merged


def _unique_names(items: list[Mapping[str, Any]]) -> list[Manifest]:
    seen: dict[str, Manifest] = {}
    for item in items:
        seen.setdefault(item["name"], {"name": item["name"]})
    return list(seen.values())
