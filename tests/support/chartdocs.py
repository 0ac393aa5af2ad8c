"""Reading a rendered chart: documents of a kind, the operator's Deployment and container,
and every grant its RBAC gives the operator's ServiceAccount."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping


def of_kind(docs: Iterable[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def operator_deployment(docs: Iterable[Mapping[str, Any]]) -> Mapping[str, Any]:
    (deployment,) = of_kind(docs, "Deployment")
    return deployment


def operator_container(docs: Iterable[Mapping[str, Any]]) -> Mapping[str, Any]:
    (container,) = operator_deployment(docs)["spec"]["template"]["spec"]["containers"]
    return container


@dataclasses.dataclass(frozen=True)
class Grant:
    """One (group, resource, verb[, name]) a bound rule gives, where the binding holds."""

    group: str
    resource: str
    verb: str
    namespace: str | None   # None: everywhere (ClusterRoleBinding)
    name: str | None = None

    def __str__(self) -> str:
        where = f"in {self.namespace}" if self.namespace else "everywhere"
        return (f"{self.verb} {self.resource}{'.' + self.group if self.group else ''} {where}"
                + (f" ({self.name})" if self.name else ""))


def operator_grants(docs: list[dict[str, Any]]) -> list[Grant]:
    """Every grant the rendered chart gives to the operator's ServiceAccount."""
    deployment = operator_deployment(docs)
    account = (deployment["metadata"]["namespace"], deployment["spec"]["template"]["spec"]["serviceAccountName"])
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("ClusterRole", "Role")}
    grants = []
    for binding in docs:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(s["kind"] == "ServiceAccount" and (s["namespace"], s["name"]) == account
                   for s in binding["subjects"]):
            continue
        namespace = binding["metadata"]["namespace"] if binding["kind"] == "RoleBinding" else None
        ref = binding["roleRef"]
        role = roles[(ref["kind"], namespace if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule
            for value in (*rule["apiGroups"], *rule["resources"], *rule["verbs"]):
                assert "*" not in value, f"wildcard in the operator's rules: {rule}"
            names = rule.get("resourceNames") or [None]
            grants += [Grant(group, resource, verb, namespace, name) for group in rule["apiGroups"]
                       for resource in rule["resources"] for verb in rule["verbs"] for name in names]
    return grants
