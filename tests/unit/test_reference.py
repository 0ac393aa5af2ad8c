"""docs/reference.md, the field reference, is generated from the CRD by tools/gen-reference:
it fails here while it is stale, and what the generator makes of a field is checked on a
field added to the CRD in memory."""

from __future__ import annotations

import runpy
from typing import Any, Callable

import yaml

from support.paths import REPO

CRD = REPO / "crds" / "distbelief.io_distbeliefjobs.yaml"
REFERENCE = REPO / "docs" / "reference.md"
GENERATOR = REPO / "tools" / "gen-reference"


def generator() -> Callable[[str], str]:
    generate: Callable[[str], str] = runpy.run_path(str(GENERATOR))["generate"]
    return generate


def spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def row(text: str, path: str) -> list[str]:
    (line,) = [line for line in text.splitlines() if line.startswith(f"| `{path}` |")]
    return [cell.strip() for cell in line.strip("|").split(" | ")]


def test_the_reference_is_what_the_generator_makes_of_the_crd() -> None:
    fresh = generator()(CRD.read_text(encoding="utf-8"))
    assert REFERENCE.read_text(encoding="utf-8") == fresh, "docs/reference.md is stale: run tools/gen-reference"


def test_a_field_gets_its_type_default_bounds_description_and_rules() -> None:
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    training = spec_schema(crd)["properties"]["training"]
    training["properties"]["warmupSeconds"] = {"type": "number", "minimum": 0, "maximum": 600, "default": 0.00005,
                                               "description": "Seconds of warm-up."}
    training["properties"]["schedule"] = {"type": "string", "enum": ["constant", "cosine"],
                                          "pattern": "^([0-9]+(\\.[0-9]+)?(ms|s|m|h))+$"}
    training["x-kubernetes-validations"].append(
        {"rule": "true", "fieldPath": ".warmupSeconds", "message": "needs spec.training.algorithm: downpour"})
    text = generator()(yaml.safe_dump(crd, sort_keys=False))
    assert row(text, "spec.training.warmupSeconds") == [
        "`spec.training.warmupSeconds`", "number", "`0.00005`", "0 to 600",
        "Seconds of warm-up. Rules: needs spec.training.algorithm: downpour."]
    schedule = row(text, "spec.training.schedule")
    assert schedule[3] == ("one of `constant`, `cosine`; "
                           "a duration: a number with a unit ms, s, m or h, for example 90s, 30m, 2h or 1h30m")


def test_the_reference_names_every_rule_and_each_role_once() -> None:
    """Every CEL message of the CRD is in the reference, and a schema the CRD repeats by a
    YAML anchor (the workers' template) points at its first place rather than repeating it."""
    text = REFERENCE.read_text(encoding="utf-8")
    crd_text = CRD.read_text(encoding="utf-8")
    messages = [rule["message"].removeprefix("metadata.name: ") for rule in _rules(yaml.safe_load(crd_text))]
    assert len(messages) > 40
    missing = [m for m in messages if " ".join(m.split()).replace("|", "\\|").replace("<", "&lt;") not in text]
    assert not missing, f"docs/reference.md lacks the rules {missing}"
    assert row(text, "spec.workers.template")[4].startswith("as `spec.parameterServers.template`")
    assert "`spec.workers.template.spec.nodeSelector`" not in text
    assert "must be a DNS-1035 label" in row(text, "metadata.name")[3]


def _rules(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        return list(node.get("x-kubernetes-validations", [])) + [r for v in node.values() for r in _rules(v)]
    if isinstance(node, list):
        return [r for v in node for r in _rules(v)]
    return []
