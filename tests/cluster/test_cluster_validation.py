"""Bad jobs are refused where users see it: every rule of spec.validate_job, on a real API server.

The CRD says the rules an OpenAPI schema cannot (cross-field rules, the data-source
grammar, name lengths) again as CEL (x-kubernetes-validations), so `kubectl apply`
refuses a bad job naming the field. For each rule, examples that break it and examples
that just keep it: the server (a dry-run create) and `distbelief validate` give the same
verdict, naming the same field. A job the CRD admits anyway (a server whose CRD lacks the
rules, a job stored before they came) fails visibly: phase Failed, reason InvalidSpec, a
Warning Event.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from distbelief.operator import errors
from distbelief.operator.validation import spec
from distbelief.runtime import contract
from support.cli import run_cli
from support.cluster import CRD_NAME, JOBS, Api, ApiError, Kubectl, Operator

from support.examples import load_example
from support.kubejobs import condition, phase_is

Edit = Callable[[dict[str, Any]], None]


def setting(**paths: Any) -> Edit:
    """An edit that sets each dotted path (under the document) to its value; None removes it."""
    def edit(doc: dict[str, Any]) -> None:
        for path, value in paths.items():
            *parents, last = path.split("__")
            node = doc
            for key in parents:
                node = node.setdefault(key, {})
            if value is None:
                node.pop(last, None)
            else:
                node[last] = copy.deepcopy(value)
    return edit


def also(*edits: Edit) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        for one in edits:
            one(doc)
    return edit


MLP = "spec__model"
PARTITIONED = setting(spec__model={"type": "mlp", "hiddenLayers": [16, 16], "partitions": 2})
SANDBLASTER = setting(spec__training__algorithm="sandblaster")
EMBEDDINGS = setting(spec__model={"type": "softmax", "embeddings": {"dim": 4}},
                     spec__data__source="synthetic-ctr:fields=2,ids=100,samples=100")
USER_MODEL = setting(spec__model={"entrypoint": "my_pkg.models:build"})
BF16 = setting(spec__parameterServers__wireFormat="bfloat16")
BACKUPS = setting(spec__parameterServers__backups=1)
JOURNAL = setting(spec__parameterServers__journal=True)
OVERLAP = setting(spec__training__overlap=True)


def worker_template(**template: Any) -> Edit:
    return setting(spec__workers__template=template)


def source(text: str) -> Edit:
    return setting(spec__data__source=text)


# (rule, the field both must name, an example that breaks the rule, an example that keeps it)
RULES: list[tuple[str, str, Edit, Edit]] = [
    ("name is a DNS-1035 label", "metadata.name", setting(metadata__name="1digits"), setting(metadata__name="d1")),
    ("name has no dots", "metadata.name", setting(metadata__name="a.b"), setting(metadata__name="a-b")),
    ("name fits the children's names", "metadata.name", setting(metadata__name="a" * 55),
     setting(metadata__name="a" * contract.MAX_JOB_NAME)),
    ("a model is built in or user code", "spec.model.entrypoint",
     setting(spec__model={"type": "mlp", "entrypoint": "my_pkg.models:build"}), USER_MODEL),
    ("user models have no embeddings", "spec.model.embeddings",
     setting(spec__model={"entrypoint": "my_pkg.models:build", "embeddings": {"dim": 4}}), EMBEDDINGS),
    ("embeddings need downpour", "spec.model.embeddings", also(EMBEDDINGS, SANDBLASTER), EMBEDDINGS),
    ("partitions need downpour", "spec.model.partitions", also(PARTITIONED, SANDBLASTER), PARTITIONED),
    ("partitions need a built-in model", "spec.model.partitions",
     setting(spec__model={"entrypoint": "my_pkg.models:build", "partitions": 2}),
     setting(spec__model={"entrypoint": "my_pkg.models:build", "partitions": 1})),
    ("partitions need an mlp", "spec.model.partitions", setting(spec__model={"type": "softmax", "partitions": 2}),
     setting(spec__model={"type": "softmax", "partitions": 1})),
    ("partitions need as many layers", "spec.model.partitions",
     setting(spec__model={"type": "mlp", "hiddenLayers": [16], "partitions": 3},
             spec__parameterServers__shards=3),
     setting(spec__model={"type": "mlp", "hiddenLayers": [16, 16], "partitions": 3},
             spec__parameterServers__shards=3)),
    ("partitions have no embeddings", "spec.model.partitions",
     setting(spec__model={"type": "mlp", "partitions": 2, "embeddings": {"dim": 4}},
             spec__data__source="synthetic-ctr:fields=2,ids=100,samples=100"), PARTITIONED),
    ("partitions need as many shards", "spec.model.partitions", also(PARTITIONED, setting(
        spec__parameterServers__shards=1)), also(PARTITIONED, setting(spec__parameterServers__shards=2))),
    ("builtin data sets are known", "spec.data.source", source("builtin:mnist"), source("builtin:digits")),
    ("synthetic: key=value", "spec.data.source", source("synthetic:features=8,classes=2,samples"),
     source("synthetic: features = 8 , classes=2,samples=100")),
    ("synthetic: known keys", "spec.data.source", source("synthetic:features=8,classes=2,samples=100,noise=1"),
     source("synthetic:features=8,classes=2,samples=100,seed=1")),
    ("synthetic: integers", "spec.data.source", source("synthetic:features=8.5,classes=2,samples=100"),
     source("synthetic:features=+8,classes=2,samples=100")),
    ("synthetic: required keys", "spec.data.source", source("synthetic:features=8,classes=2"),
     source("synthetic:samples=100,classes=2,features=8")),
    ("synthetic: no key twice", "spec.data.source", source("synthetic:features=8,classes=2,samples=100,features=9"),
     source("synthetic:features=8,classes=2,samples=100")),
    ("synthetic-ctr: known keys", "spec.data.source",
     also(EMBEDDINGS, source("synthetic-ctr:fields=2,ids=100,samples=100,zipf=1.5,alpha=2")),
     also(EMBEDDINGS, source("synthetic-ctr:fields=2,ids=100,samples=100,zipf=1.5,seed=2"))),
    ("synthetic-ctr: a real zipf", "spec.data.source",
     also(EMBEDDINGS, source("synthetic-ctr:fields=2,ids=100,samples=100,zipf=x")),
     also(EMBEDDINGS, source("synthetic-ctr:fields=2,ids=100,samples=100,zipf=.75"))),
    ("synthetic-ctr: required keys", "spec.data.source", also(EMBEDDINGS, source("synthetic-ctr:fields=2,samples=100")),
     EMBEDDINGS),
    ("synthetic-ctr: no key twice", "spec.data.source",
     also(EMBEDDINGS, source("synthetic-ctr:fields=2,ids=100,samples=100,ids=5")), EMBEDDINGS),
    ("synthetic-ctr needs embeddings", "spec.data.source",
     setting(spec__data__source="synthetic-ctr:fields=2,ids=100,samples=100"), EMBEDDINGS),
    ("npz paths are absolute", "spec.data.source", source("npz:data/train.npz"), source("npz:/srv/train.npz")),
    ("npz under the volume", "spec.data.source", setting(spec__data__source="npz:/srv/train.npz",
                                                         spec__data__volume="training-data"),
     setting(spec__data__source="npz:/data/train.npz", spec__data__volume="training-data")),
    ("parquet paths are absolute", "spec.data.source", source("parquet:data/*.parquet"),
     source("parquet:/srv/train/*.parquet")),
    ("csv under the volume", "spec.data.source", setting(spec__data__source="csv:/srv/*.csv.gz",
                                                         spec__data__volume="training-data"),
     setting(spec__data__source="csv:/data/*.csv.gz", spec__data__volume="training-data")),
    ("held-out files need a file source", "spec.data.test", setting(spec__data__test="/srv/test.npz"),
     setting(spec__data__source="npz:/srv/train-*.npz", spec__data__test="/srv/test.npz")),
    ("columns need a file source", "spec.data.label", setting(spec__data__features=["a"]),
     setting(spec__data__source="parquet:/srv/*.parquet", spec__data__features=["a"], spec__data__label="click")),
    ("objectStore is for s3://", "spec.data.objectStore",
     setting(spec__data__objectStore={"endpoint": "http://minio:9000"}),
     setting(spec__data__source="s3://train-data/clicks/*.parquet", spec__data__objectStore={"endpoint": "http://minio:9000"})),
    ("s3 held-out files are s3", "spec.data.test",
     setting(spec__data__source="s3://train-data/clicks/*.parquet", spec__data__test="/data/eval.parquet"),
     setting(spec__data__source="s3://train-data/clicks/*.parquet", spec__data__test="s3://train-data/eval/*.parquet")),
    ("maxDuration > 0", "spec.training.maxDuration", setting(spec__training__maxDuration="0m0s"),
     setting(spec__training__maxDuration="0.5s")),
    ("maxDuration is a duration", "spec.training.maxDuration", setting(spec__training__maxDuration="5x"),
     setting(spec__training__maxDuration="1h30m")),
    ("autoscaling min <= max", "spec.workers.autoscaling.minReplicas",
     setting(spec__workers__autoscaling={"minReplicas": 5, "maxReplicas": 2}),
     setting(spec__workers__autoscaling={"minReplicas": 2, "maxReplicas": 2})),
    ("backups need downpour", "spec.parameterServers.backups", also(BACKUPS, SANDBLASTER), BACKUPS),
    ("the journal is for shards without backups", "spec.parameterServers.journal", also(JOURNAL, BACKUPS), JOURNAL),
    ("the journal needs downpour", "spec.parameterServers.journal", also(JOURNAL, SANDBLASTER), JOURNAL),
    ("backups need unexpired rows", "spec.parameterServers.backups",
     also(BACKUPS, EMBEDDINGS, setting(spec__model__embeddings={"dim": 4, "expireAfterSeconds": 60})),
     also(BACKUPS, EMBEDDINGS)),
    ("backups run as their own account", "spec.parameterServers.backups",
     also(BACKUPS, setting(spec__parameterServers__template={"spec": {"serviceAccountName": "mine"}})),
     also(BACKUPS, setting(spec__parameterServers__template={"spec": {"priorityClassName": "high"}}))),
    ("templates keep the shard copies' token", "spec.parameterServers.template.spec.volumes",
     setting(spec__parameterServers__template={"spec": {"volumes": [{"name": "view-lease-token", "emptyDir": {}}]}}),
     setting(spec__parameterServers__template={"spec": {"volumes": [{"name": "lease", "emptyDir": {}}]}})),
    ("bfloat16 needs downpour", "spec.parameterServers.wireFormat", also(BF16, SANDBLASTER), BF16),
    ("bfloat16 has no embeddings", "spec.parameterServers.wireFormat", also(BF16, EMBEDDINGS),
     also(EMBEDDINGS, setting(spec__parameterServers__wireFormat="float32"))),
    ("bfloat16 needs one partition", "spec.parameterServers.wireFormat", also(BF16, PARTITIONED),
     also(BF16, setting(spec__model__partitions=1))),
    ("micro-batches need partitions", "spec.model.microBatches", setting(spec__model__microBatches=4),
     also(PARTITIONED, setting(spec__model__microBatches=4))),
    ("micro-batches fit the minibatch", "spec.model.microBatches",
     also(PARTITIONED, setting(spec__model__microBatches=8, spec__training__batchSize=4)),
     also(PARTITIONED, setting(spec__model__microBatches=4, spec__training__batchSize=4))),
    ("overlap pushes and pulls every step", "spec.training.overlap",
     also(OVERLAP, setting(spec__training__fetchEvery=2)), also(OVERLAP, setting(spec__training__fetchEvery=1))),
    ("overlap needs downpour", "spec.training.overlap", also(OVERLAP, SANDBLASTER), OVERLAP),
    ("overlap has no embeddings", "spec.training.overlap", also(OVERLAP, EMBEDDINGS), EMBEDDINGS),
    ("overlap needs one partition", "spec.training.overlap", also(OVERLAP, PARTITIONED),
     also(OVERLAP, setting(spec__model__partitions=1))),
    ("overlap needs a staleness bound of 1 or more", "spec.training.overlap",
     also(OVERLAP, setting(spec__training__maxStaleness=0)), also(OVERLAP, setting(spec__training__maxStaleness=1))),
    ("templates keep the operator's labels", "spec.workers.template.metadata.labels",
     worker_template(metadata={"labels": {"distbelief.io/role": "ps"}}),
     worker_template(metadata={"labels": {"team": "ml"}})),
    ("templates keep the operator's annotations", "spec.workers.template.metadata.annotations",
     worker_template(metadata={"annotations": {"distbelief.io/config-hash": "0"}}),
     worker_template(metadata={"annotations": {"example.com/team": "ml"}})),
    ("templates keep the pod's hardening", "spec.parameterServers.template.spec",
     setting(spec__parameterServers__template={"spec": {"securityContext": {"runAsUser": 0}}}),
     setting(spec__parameterServers__template={"spec": {"priorityClassName": "high"}})),
    ("templates keep the operator's volumes", "spec.workers.template.spec.volumes",
     worker_template(spec={"volumes": [{"name": "keys", "emptyDir": {}}]}),
     worker_template(spec={"volumes": [{"name": "cache", "emptyDir": {}}]})),
    ("templates keep the container's command", "spec.workers.template.spec.containers[0]",
     worker_template(spec={"containers": [{"command": ["sh"]}]}),
     worker_template(spec={"containers": [{"env": [{"name": "A", "value": "1"}]}]})),
    ("templates keep the operator's env names", "spec.workers.template.spec.containers[0].env",
     worker_template(spec={"containers": [{"env": [{"name": "DISTBELIEF_PARTITION", "value": "1"}]}]}),
     worker_template(spec={"containers": [{"env": [{"name": "PARTITION", "value": "1"}]}]})),
    ("templates keep the operator's mounts", "spec.workers.template.spec.containers[0].volumeMounts",
     worker_template(spec={"containers": [{"volumeMounts": [{"name": "c", "mountPath": "/etc/distbelief/x"}]}]}),
     worker_template(spec={"containers": [{"volumeMounts": [{"name": "c", "mountPath": "/etc/distbelief2"}]}]})),
    ("a template's container is the role's", "spec.parameterServers.template.spec.containers",
     setting(spec__parameterServers__template={"spec": {"containers": [{"name": "worker"}]}}),
     setting(spec__parameterServers__template={"spec": {"containers": [{"name": "ps"}]}})),
]


def generator_text(kind: str, base: dict[str, int], key: str, value: float) -> str:
    """A generator source with every required parameter at base, and key at value."""
    shown = f"{value:g}" if key in contract.REAL_PARAMETERS else str(int(value))
    return f"{kind}:" + ",".join(f"{k}={shown if k == key else v}" for k, v in {**base, key: 0}.items())


def bound_rules() -> Iterator[tuple[str, str, Edit, Edit]]:
    """Every bound of every generator parameter: just inside is kept, just outside broken."""
    generators = (("synthetic", contract.SYNTHETIC_BOUNDS, contract.SYNTHETIC_REQUIRED, lambda edit: edit),
                  ("synthetic-ctr", contract.CTR_BOUNDS, contract.CTR_REQUIRED, lambda edit: also(EMBEDDINGS, edit)))
    for kind, bounds, required, wrap in generators:
        base = {key: int(low) + 10 for key, (low, _) in bounds.items() if key in required}
        for key, (low, high) in bounds.items():
            step = 0.1 if key in contract.REAL_PARAMETERS else 1
            for edge, outside in ((low, low - step), (high, high + step)):
                yield (f"{kind}: {key} within {low:g}..{high:g}", "spec.data.source",
                       wrap(source(generator_text(kind, base, key, outside))),
                       wrap(source(generator_text(kind, base, key, edge))))


ALL_RULES = RULES + list(bound_rules())
IDS = [f"{rule} ({i})" for i, (rule, *_) in enumerate(ALL_RULES)]


def example(edit: Edit) -> dict[str, Any]:
    doc = copy.deepcopy(load_example("digits-mlp.yaml"))
    edit(doc)
    return doc


def server_refusal(api: Api, namespace: str, doc: dict[str, Any]) -> str | None:
    """The server's answer to creating doc (dry run): its message, or None when it accepts."""
    try:
        api.request("POST", api.path(JOBS, namespace), doc, query={"dryRun": "All"})
    except ApiError as exc:
        if exc.code != 422:
            raise
        return json.loads(exc.body)["message"]
    return None


def local_refusal(doc: dict[str, Any]) -> list[str]:
    try:
        spec.validate_job(doc)
    except errors.SpecError as exc:
        return list(exc.errors)
    return []


@pytest.mark.parametrize("rule, field, breaking, keeping", ALL_RULES, ids=IDS)
def test_the_api_server_and_the_validator_agree_on_every_rule(api: Api, chart: str, namespace: str, rule: str,
                                                               field: str, breaking: Edit, keeping: Edit) -> None:
    kept = example(keeping)
    assert local_refusal(kept) == [], rule
    assert server_refusal(api, namespace, kept) is None, rule
    broken = example(breaking)
    assert any(line.startswith(field) for line in local_refusal(broken)), (rule, local_refusal(broken))
    refused = server_refusal(api, namespace, broken)
    assert refused is not None, f"the API server admits a job that breaks: {rule}"
    assert field in refused, (rule, refused)


def test_kubectl_apply_refuses_a_bad_job_naming_the_field(kubectl: Kubectl, chart: str, namespace: str) -> None:
    """Sandblaster with backups, a 55-character name, synthetic:features=0, autoscaling with
    min > max."""
    cases = [(also(SANDBLASTER, BACKUPS), "spec.parameterServers.backups"),
             (setting(metadata__name="a" * 55), "metadata.name"),
             (source("synthetic:features=0,classes=2,samples=100"), "spec.data.source"),
             (setting(spec__workers__autoscaling={"minReplicas": 5, "maxReplicas": 2}),
              "spec.workers.autoscaling.minReplicas")]
    for edit, field in cases:
        done = kubectl.run("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(example(edit)))
        assert done.returncode != 0 and field in done.stderr, done.stderr


def test_distbelief_validate_gives_the_same_verdicts(tmp_path: Path) -> None:
    """The command users run locally, on every rule's examples at once."""
    files = {}
    for i, (rule, field, breaking, keeping) in enumerate(ALL_RULES):
        for verdict, edit in (("broken", breaking), ("kept", keeping)):
            path = tmp_path / f"{i}-{verdict}.yaml"
            path.write_text(yaml.safe_dump(example(edit)))
            files[str(path)] = (verdict, field, rule)
    done = run_cli("validate", *files, timeout=120)
    assert done.returncode == contract.EXIT_INVALID_CONFIG
    for path, (verdict, field, rule) in files.items():
        if verdict == "kept":
            assert f"{path}: valid" in done.stdout, rule
        else:
            assert f"{path}: {field}" in done.stderr, rule


# ------------------------------------------------------------------ what only the operator judges


@pytest.fixture
def crd_without_rules(api: Api, kubectl: Kubectl, chart: str) -> Iterator[None]:
    """The CRD as a server without its CEL rules has it (an older CRD, never upgraded); put
    back afterwards."""
    crds = "apiextensions.k8s.io/v1/customresourcedefinitions"
    original = api.get(crds, None, CRD_NAME)

    def strip(schema: Any) -> Any:
        if isinstance(schema, dict):
            return {k: strip(v) for k, v in schema.items() if k != "x-kubernetes-validations"}
        return [strip(v) for v in schema] if isinstance(schema, list) else schema

    lax = copy.deepcopy(original)
    lax["spec"]["versions"] = strip(lax["spec"]["versions"])
    api.request("PUT", api.path(crds, None, CRD_NAME), lax)
    try:
        yield
    finally:
        current = api.get(crds, None, CRD_NAME)
        original["metadata"] = {"name": CRD_NAME, "resourceVersion": current["metadata"]["resourceVersion"],
                                "labels": original["metadata"].get("labels", {})}
        api.request("PUT", api.path(crds, None, CRD_NAME), original)


@pytest.mark.floors  # the operator's API calls, also against the lowest dependency versions
def test_a_job_only_the_operator_can_judge_fails_visibly(operator: Operator, api: Api, kubectl: Kubectl,
                                                          crd_without_rules: None, namespace: str) -> None:
    doc = example(also(SANDBLASTER, BACKUPS))
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))  # admitted: no rules on the server
    job = api.wait(JOBS, namespace, "digits", phase_is("Failed"))
    failed = condition(job, "Failed")
    assert failed["reason"] == "InvalidSpec" and "spec.parameterServers.backups" in failed["message"]
    assert job["status"]["observedGeneration"] == job["metadata"]["generation"]
    warning = api.wait_event(namespace, "digits", "InvalidSpec")
    assert warning["type"] == "Warning" and "spec.parameterServers.backups" in warning["message"]
    assert api.get("apps/v1/statefulsets", namespace, "digits-ps") is None  # nothing was made for it
    assert "Failed" in kubectl("get", "dbj", "digits", "-n", namespace)
