"""The CRD and the chart on a real kube-apiserver (1.36): installed with the real helm, every
example created for real, the server's defaults equal to the validator's, and every bound
of the schema one the server accepts."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from distbelief.operator import errors
from distbelief.operator.render import context, render
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from support.cluster import CRD_NAME, Kubectl
from support.paths import REPO

EXAMPLES = sorted(p for p in (REPO / "examples").rglob("*.yaml"))


def test_the_chart_installs_the_crd_and_the_operator(chart: str, kubectl: Kubectl, helm: Callable[..., str]) -> None:
    (release,) = json.loads(helm("list", "--namespace", chart, "--output", "json"))
    assert release["status"] == "deployed"
    crd = kubectl.json("get", "crd", CRD_NAME)
    assert crd["spec"]["versions"][0]["subresources"].keys() == {"status", "scale"}
    (operator,) = kubectl.json("get", "deployment", "-n", chart, "-l", "app.kubernetes.io/name=distbelief")["items"]
    pod = operator["spec"]["template"]["spec"]
    assert "operator" in pod["containers"][0]["args"]
    account = f"system:serviceaccount:{chart}:{pod['serviceAccountName']}"
    assert kubectl("auth", "can-i", "patch", "distbeliefjobs.distbelief.io", "--subresource=status",
                   f"--as={account}").strip() == "yes"


def test_the_chart_lets_the_operator_grant_the_shard_pods_their_leases(chart: str, kubectl: Kubectl,
                                                                        namespace: str) -> None:
    """A job with backups: the operator, as the chart's ServiceAccount, creates the shard pods'
    ServiceAccount, Role and RoleBinding (a Role grants only what its maker holds)."""
    (operator,) = kubectl.json("get", "deployment", "-n", chart, "-l", "app.kubernetes.io/name=distbelief")["items"]
    account = f"system:serviceaccount:{chart}:{operator['spec']['template']['spec']['serviceAccountName']}"
    doc = copy.deepcopy(BASE)
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["parameterServers"]["backups"] = 1
    objs = [o for o in render.render_children(DistBeliefJob.validated(doc), image=context.DEFAULT_IMAGE)
            if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    assert len(objs) == 3
    kubectl("create", "-n", namespace, f"--as={account}", "-f", "-", input=render.to_yaml(objs))
    shards = f"system:serviceaccount:{namespace}:digits-ps"
    assert kubectl("auth", "can-i", "update", "leases/digits-shard-1", "-n", namespace, f"--as={shards}").strip() == "yes"
    assert kubectl.run("auth", "can-i", "update", "leases/other-shard-0", "-n", namespace,
                       f"--as={shards}").stdout.strip() == "no"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(REPO / "examples").as_posix())
def test_every_example_is_created_with_the_defaults_the_validator_applies(
        chart: str, kubectl: Kubectl, namespace: str, path: Path) -> None:
    (doc,) = spec.load_manifests(str(path))
    kubectl("create", "-n", namespace, "-f", str(path))
    created = kubectl.json("get", "dbj", doc["metadata"]["name"], "-n", namespace)
    assert created["spec"] == spec.validate_job(doc)["spec"]


def bounded_fields(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict]]:
    """(path, schema) of every number or integer with a bound; "[]" in a path is an array's item."""
    if schema.get("type") in ("number", "integer") and ("maximum" in schema or "minimum" in schema):
        yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from bounded_fields(child, path + (name,))
    if "items" in schema:
        yield from bounded_fields(schema["items"], path + ("[]",))


BASE = yaml.safe_load((REPO / "examples" / "digits-mlp.yaml").read_text())
BOUNDS = [(path, edge, schema) for path, schema in bounded_fields(spec.openapi_schema())
          for edge in ("maximum", "minimum") if edge in schema and path[0] == "spec"]


def with_value(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """The base example with the field at path set to value (the objects on the way made)."""
    doc = copy.deepcopy(BASE)
    node: Any = doc
    for key, following in zip(path, path[1:]):
        fresh: Any = [] if following == "[]" else {}
        if key == "[]":
            node[:] = node[:1] or [fresh]
            node = node[0]
        else:
            if not isinstance(node.get(key), (dict, list)):
                node[key] = fresh
            node = node[key]
    if path[-1] == "[]":
        node[:] = [value]
    else:
        node[path[-1]] = value
    return doc


def edge_value(schema: dict[str, Any], edge: str, beyond: bool) -> float | int:
    value = schema[edge]
    exclusive = schema.get("exclusiveMaximum" if edge == "maximum" else "exclusiveMinimum", False)
    step = 1 if schema["type"] == "integer" else abs(value) * 0.5 or 0.5
    inward = -step if edge == "maximum" else step
    if exclusive and not beyond:
        value += inward
    elif beyond and not exclusive:
        value -= inward
    return int(value) if schema["type"] == "integer" else float(value)


BOUND_WORDS = ("less than or equal to", "greater than or equal to", "should be less than", "should be greater than")


@pytest.mark.parametrize("path, edge, schema", BOUNDS, ids=[".".join(p) + ":" + e for p, e, _ in BOUNDS])
def test_every_bound_of_the_schema_is_one_the_api_server_holds(
        chart: str, kubectl: Kubectl, namespace: str, path: tuple[str, ...], edge: str, schema: dict) -> None:
    """At the bound the server finds nothing out of bounds; beyond it the server and the
    validator both refuse, naming the field. A bound the server cannot represent (an int64
    overflow) fails here. Other rules (a partition count the model cannot hold) may refuse
    either document: they are not what this test is about."""
    field = [p for p in path if p != "[]"][-1]

    def bound_complaints(doc: dict) -> list[str]:
        done = kubectl.run("create", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(doc))
        return [] if done.returncode == 0 else [line for line in done.stderr.split(", ")
                                                if field in line and any(w in line for w in BOUND_WORDS)]

    assert bound_complaints(with_value(path, edge_value(schema, edge, beyond=False))) == []
    outside = with_value(path, edge_value(schema, edge, beyond=True))
    assert bound_complaints(outside), f"the server accepts {field} beyond its {edge}"
    with pytest.raises(errors.SpecError, match=field):
        spec.validate_job(outside)


def notes(helm: Callable[..., str], *args: str) -> str:
    out = helm("install", "distbelief", str(REPO / "charts" / "distbelief"), "--namespace", "distbelief-system",
               "--dry-run=client", *args)
    assert "NOTES:" in out
    return out[out.index("NOTES:"):]


def test_notes_give_the_next_steps(helm: Callable[..., str], control_plane: object) -> None:
    text = notes(helm)
    assert "kubectl -n distbelief-system rollout status deployment/distbelief" in text
    assert "kubectl -n default apply -f examples/digits-mlp.yaml" in text
    assert "kubectl -n default get dbj digits --watch" in text
    assert "in every namespace" in text and "ClusterKopfPeering" in text
    assert "kubectl apply --server-side --force-conflicts -f crds/distbelief.io_distbeliefjobs.yaml" in text
    assert "docs/install.md" in text
    scoped = notes(helm, "--set", "operator.watchNamespaces={ml,research}", "--set", "peering.enabled=false")
    assert "in: ml, research" in scoped
    assert "kubectl -n ml apply -f examples/digits-mlp.yaml" in scoped
    assert "KopfPeering" not in scoped
    for line in scoped.splitlines():  # every example job mentioned exists
        if "-f examples/" in line:
            assert (REPO / line.split("-f ")[1].split()[0]).is_file()
