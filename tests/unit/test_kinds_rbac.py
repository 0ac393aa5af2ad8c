"""The chart's RBAC against the operator's table of kinds (render/kinds.py): every verb the
table implies is granted, and the operator's namespaced rules grant nothing it does not
name. Read from the chart's files, without helm: the namespaced rules are plain YAML in
_helpers.tpl; rbac.yaml's template lines are dropped and its expressions stubbed."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import yaml

from distbelief.operator.render import kinds
from support.paths import REPO

TEMPLATES = REPO / "charts" / "distbelief" / "templates"
# (API group, resource or resource/subresource, verb)
Grant = tuple[str, str, str]


def _grants(rules: Iterable[dict]) -> Iterator[Grant]:
    """Every (group, resource, verb) the rules grant; a rule narrowed to resourceNames counts
    (the operator's peering object is the one it patches)."""
    for rule in rules:
        yield from ((group, resource, verb) for group in rule["apiGroups"] for resource in rule["resources"]
                    for verb in rule["verbs"])


def namespaced_rules() -> list[dict]:
    text = (TEMPLATES / "_helpers.tpl").read_text(encoding="utf-8")
    block = text.split('{{- define "distbelief.namespacedRules" -}}', 1)[1].split("{{- end -}}", 1)[0]
    return yaml.safe_load(block)


def operator_roles_rules() -> list[dict]:
    """The rules of rbac.yaml's ClusterRole and Roles for the operator (not the aggregated
    roles for people), template lines dropped, expressions stubbed."""
    text = (TEMPLATES / "rbac.yaml").read_text(encoding="utf-8")
    lines = [re.sub(r"\{\{.*?\}\}", "stub", line) for line in text.splitlines()
             if not line.strip().startswith("{{")]
    documents = [d for d in yaml.safe_load_all("\n".join(lines)) if d]
    return [rule for d in documents if d["kind"] in ("ClusterRole", "Role") and not _for_people(d)
            for rule in d.get("rules") or []]


def _for_people(role: dict) -> bool:
    labels = role["metadata"].get("labels") or {}
    return any(label.startswith("rbac.authorization.k8s.io/aggregate-to-") for label in labels)


def implied(kind: kinds.Kind) -> set[Grant]:
    grants = {(kind.group, kind.plural, verb) for verb in kind.verbs}
    for subresource, verbs in kind.subresources:
        grants |= {(kind.group, f"{kind.plural}/{subresource}", verb) for verb in verbs}
    return grants


def test_the_chart_grants_every_verb_the_table_of_kinds_implies() -> None:
    granted = set(_grants(namespaced_rules())) | set(_grants(operator_roles_rules()))
    missing = {grant for kind in kinds.KINDS for grant in implied(kind)} - granted
    assert not missing, f"the chart's RBAC lacks {sorted(missing)}"


def test_the_namespaced_rules_grant_only_what_the_table_names() -> None:
    named = {grant for kind in kinds.KINDS if not kind.cluster_wide for grant in implied(kind)}
    extra = set(_grants(namespaced_rules())) - named
    assert not extra, f"the chart grants {sorted(extra)}, which no row of render/kinds.py names"


def test_a_verb_dropped_from_the_chart_is_found() -> None:
    """The check above would miss nothing it is meant to see: remove one grant from the
    rules and it is reported."""
    rules = namespaced_rules()
    (hpa,) = [r for r in rules if r["resources"] == ["horizontalpodautoscalers"]]
    hpa["verbs"].remove("delete")
    granted = set(_grants(rules)) | set(_grants(operator_roles_rules()))
    missing = {grant for kind in kinds.KINDS for grant in implied(kind)} - granted
    assert missing == {("autoscaling", "horizontalpodautoscalers", "delete")}


def test_the_derived_tables_come_from_the_kinds() -> None:
    assert kinds.PLURALS[("autoscaling/v2", "HorizontalPodAutoscaler")] == "horizontalpodautoscalers"
    assert ("apps/v1", "statefulsets") in kinds.WATCHED_CHILDREN
    assert ("v1", "secrets") not in kinds.WATCHED_CHILDREN
    assert set(kinds.OPTIONAL) == {("autoscaling/v2", "HorizontalPodAutoscaler"),
                                   ("networking.k8s.io/v1", "NetworkPolicy")}
