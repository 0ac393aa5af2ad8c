"""DistBeliefJob validation (distbelief.operator.validation) and the CRD it is driven by."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from distbelief.operator import cli
from distbelief.operator.errors import SpecError
from distbelief.operator.validation import spec, templates
from distbelief.runtime import contract
from support.paths import REPO

pytestmark = pytest.mark.floors  # also run against the lowest dependency versions

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CRD_FILE = REPO / "crds" / "distbelief.io_distbeliefjobs.yaml"
K8S_VERSION = "1.30"

MINIMAL: dict[str, Any] = {
    "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
    "kind": contract.KIND,
    "metadata": {"name": "mini"},
    "spec": {"data": {"source": "builtin:digits"}},
}


def good() -> dict[str, Any]:
    """A job using most of the spec, valid as it stands; each bad case mutates a copy."""
    return {
        "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
        "kind": contract.KIND,
        "metadata": {"name": "good", "namespace": "team-a"},
        "spec": {
            "model": {"type": "mlp", "hiddenLayers": [32, 16], "activation": "tanh"},
            "data": {"source": "synthetic:features=8,classes=3,samples=100,seed=1"},
            "training": {"batchSize": 16, "learningRate": 0.05, "maxDuration": "5m"},
            "parameterServers": {
                "shards": 2,
                "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
                "checkpoint": {"storage": {"size": "1Gi", "storageClassName": "fast"}},
            },
            "workers": {"replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}},
        },
    }


def schema_at(path: str) -> Mapping[str, Any]:
    """The CRD's schema of a dotted path such as spec.training.batchSize."""
    node: Mapping[str, Any] = spec.openapi_schema()
    for key in path.split("."):
        node = node["properties"][key]
    return node


def get(doc: Any, path: str) -> Any:
    for key in path.split("."):
        doc = doc[key]
    return doc


def put(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for key in parents:
        doc = doc.setdefault(key, {})
    doc[last] = value


def drop(doc: dict[str, Any], path: str) -> None:
    *parents, last = path.split(".")
    for key in parents:
        doc = doc[key]
    del doc[last]


def errors_of(doc: Any) -> list[str]:
    with pytest.raises(SpecError) as caught:
        spec.validate_job(doc)
    assert str(caught.value) == "\n".join(caught.value.errors)
    return caught.value.errors


# ------------------------------------------------------------------ valid manifests


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(path: Path) -> None:
    docs = spec.load_manifests(str(path))
    assert docs
    for doc in docs:
        job = spec.validate_job(doc)
        assert job["metadata"]["name"] == doc["metadata"]["name"]
        assert job["spec"]["data"]["source"] == doc["spec"]["data"]["source"]


def test_good_fixture_validates() -> None:
    spec.validate_job(good())


def test_partitions_are_unset_unless_written_and_read_as_one() -> None:
    """No schema default: an unpartitioned job's resolved config, and so its config hash,
    stays as it was before the field existed."""
    job = spec.validate_job(good())
    assert "partitions" not in job["spec"]["model"]
    assert spec.job_config(job).spec.model.partitions == 1
    doc = good()
    put(doc, "spec.model.partitions", 3)   # 3 layers (32, 16, output), 3 shards
    put(doc, "spec.parameterServers.shards", 3)
    assert spec.job_config(spec.validate_job(doc)).spec.model.partitions == 3


def test_minimal_manifest_gets_the_crd_defaults() -> None:
    job = spec.validate_job(MINIMAL)
    for path in ("spec.training.batchSize", "spec.training.algorithm",
                 "spec.training.learningRate", "spec.parameterServers.shards",
                 "spec.parameterServers.port", "spec.workers.replicas",
                 "spec.runPolicy.suspend",
                 "spec.parameterServers.checkpoint.storage.retention",
                 "spec.parameterServers.checkpoint.storage.size"):
        assert get(job, path) == schema_at(path)["default"], path
    # the CRD's own values, spelled out once as a cross-check of the lookup above
    assert get(job, "spec.training.batchSize") == 32
    assert get(job, "spec.parameterServers.shards") == 1
    assert get(job, "spec.parameterServers.checkpoint.storage.retention") == "Retain"
    assert get(job, "spec.parameterServers.wireFormat") == "float32"


def test_the_schema_takes_a_bfloat16_wire_format_for_a_dense_downpour_job() -> None:
    doc = good()
    put(doc, "spec.parameterServers.wireFormat", "bfloat16")
    put(doc, "spec.parameterServers.backups", 1)  # copies replay the pushes as they came
    assert _schema_error_paths(doc) == []
    assert get(spec.validate_job(doc), "spec.parameterServers.wireFormat") == "bfloat16"
    assert spec.job_config(spec.validate_job(doc)).spec.parameter_servers.wire_format == "bfloat16"


def _defaults(schema: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, Any]]:
    for name, sub in schema.get("properties", {}).items():
        here = f"{path}.{name}" if path else name
        if "default" in sub:
            yield here, sub["default"]
        yield from _defaults(sub, here)


def test_every_default_of_the_crd_is_applied_below_defaulted_objects() -> None:
    job = spec.validate_job(MINIMAL)
    checked = 0
    for path, default in _defaults(schema_at("spec"), "spec"):
        parent = path.rpartition(".")[0]
        try:
            holder = get(job, parent)
        except KeyError:
            continue  # inside an optional object without default (autoscaling)
        value = holder[path.rpartition(".")[2]]
        if isinstance(default, dict):  # an object default: its own defaults filled it in
            assert isinstance(value, dict) and default.items() <= value.items(), path
        else:
            assert value == default, path
        checked += 1
    assert checked >= 25


def test_defaults_fill_existing_objects_and_keep_explicit_values() -> None:
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["workers"] = {"replicas": 3, "autoscaling": {"maxReplicas": 5}}
    doc["spec"]["parameterServers"] = {"checkpoint": {"storage": {"size": "5Gi"}}}
    job = spec.validate_job(doc)
    assert job["spec"]["workers"]["replicas"] == 3
    assert job["spec"]["workers"]["resources"] == {}
    assert job["spec"]["workers"]["autoscaling"]["minReplicas"] == \
        schema_at("spec.workers.autoscaling.minReplicas")["default"]
    storage = job["spec"]["parameterServers"]["checkpoint"]["storage"]
    assert storage == {"size": "5Gi", "retention": "Retain"}
    assert job["spec"]["parameterServers"]["checkpoint"]["everySeconds"] == 30


def test_optional_objects_without_default_stay_absent() -> None:
    job = spec.validate_job(MINIMAL)
    assert "autoscaling" not in job["spec"]["workers"]
    assert "image" not in job["spec"]
    assert "maxDuration" not in job["spec"]["training"]
    assert "type" not in job["spec"]["model"]


def test_validate_returns_a_copy_and_leaves_the_input_alone() -> None:
    doc = copy.deepcopy(MINIMAL)
    job = spec.validate_job(doc)
    assert doc == MINIMAL
    job["spec"]["training"]["batchSize"] = 7
    assert spec.validate_job(MINIMAL)["spec"]["training"]["batchSize"] == 32


def test_defaults_are_not_shared_between_jobs_or_with_the_crd() -> None:
    first = spec.validate_job(MINIMAL)
    first["spec"]["model"]["hiddenLayers"].append(5)
    first["spec"]["workers"]["resources"]["requests"] = {"cpu": "1"}
    second = spec.validate_job(MINIMAL)
    assert second["spec"]["model"]["hiddenLayers"] == [64]
    assert second["spec"]["workers"]["resources"] == {}
    assert second["spec"]["parameterServers"]["resources"] == {}


def test_null_fields_are_pruned_then_defaulted_like_the_api_server() -> None:
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["training"] = {"batchSize": None}
    assert spec.validate_job(doc)["spec"]["training"]["batchSize"] == 32


def test_integral_floats_are_integers() -> None:
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["parameterServers"] = {"shards": 2.0}
    shards = spec.validate_job(doc)["spec"]["parameterServers"]["shards"]
    assert shards == 2 and isinstance(shards, int)


def test_number_accepts_integers() -> None:
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["training"] = {"learningRate": 1}
    assert spec.validate_job(doc)["spec"]["training"]["learningRate"] == 1


def test_entrypoint_alone_is_fine_and_gets_no_type() -> None:
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["model"] = {"entrypoint": "my_pkg.models:build"}
    assert "type" not in spec.validate_job(doc)["spec"]["model"]


def test_metrics_items_preserve_unknown_fields() -> None:
    doc = good()
    metric = {"type": "Pods", "pods": {"metric": {"name": "x"}, "anything": {"goes": 1}}}
    doc["spec"]["workers"]["autoscaling"]["metrics"] = [metric]
    assert spec.validate_job(doc)["spec"]["workers"]["autoscaling"]["metrics"] == [metric]


def test_quantities_accept_integers_and_strings() -> None:
    doc = good()
    doc["spec"]["workers"]["resources"] = {"requests": {"cpu": 2, "memory": "1.5Gi"},
                                           "limits": {"nvidia.com/gpu": 1}}
    assert spec.validate_job(doc)["spec"]["workers"]["resources"]["limits"] == {"nvidia.com/gpu": 1}


def test_other_data_sources() -> None:
    for source in ("npz:/data/train.npz", "builtin:digits",
                   "synthetic:samples=10,classes=2,features=1"):
        doc = good()
        doc["spec"]["data"]["source"] = source
        spec.validate_job(doc)


def test_status_as_written_by_the_operator_validates() -> None:
    doc = good()
    doc["status"] = {"phase": "Running", "globalStep": 10, "loss": 0.5,
                     "workers": {"replicas": 2, "ready": 1},
                     "startTime": "2024-01-01T00:00:00Z",
                     "kopf": {"progress": {"anything": True}}}
    spec.validate_job(doc)


# --------------------------------------------------------------------- bad manifests


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: put(doc, path, value)


def _del(path: str) -> Callable[[dict[str, Any]], None]:
    return lambda doc: drop(doc, path)


def _with(path: str, value: Any, **fields: Any) -> Callable[[dict[str, Any]], None]:
    """path set to value, and other fields (dotted paths, "_" for ".") with it."""
    def mutate(doc: dict[str, Any]) -> None:
        put(doc, path, value)
        for field, other in fields.items():
            put(doc, field.replace("_", "."), other)
    return mutate


def _partitioned(partitions: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return _with("spec.model.partitions", partitions, **fields)


def _overlapped(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return _with("spec.training.overlap", True, **fields)


def _bfloat16(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return _with("spec.parameterServers.wireFormat", "bfloat16", **fields)


BAD: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("batch-too-big", _set("spec.training.batchSize", 100000), "spec.training.batchSize",
     "must be <= 65536 (got 100000)"),
    ("batch-zero", _set("spec.training.batchSize", 0), "spec.training.batchSize", ">= 1"),
    ("batch-bool", _set("spec.training.batchSize", True), "spec.training.batchSize",
     "must be of type integer (got boolean true)"),
    ("batch-fraction", _set("spec.training.batchSize", 3.5), "spec.training.batchSize",
     "integer"),
    ("lr-string", _set("spec.training.learningRate", "fast"), "spec.training.learningRate",
     "must be of type number"),
    ("lr-exclusive-minimum", _set("spec.training.learningRate", 0),
     "spec.training.learningRate", "must be > 0 (got 0)"),
    ("adagrad-boolean-replaced", _set("spec.training.adagrad", True), "spec.training.adagrad",
     "replaced by spec.training.optimizer (adagrad | sgd)"),
    ("optimizer-enum", _set("spec.training.optimizer", "adam"), "spec.training.optimizer",
     "must be one of adagrad, sgd"),
    ("algorithm-enum", _set("spec.training.algorithm", "hogwild"), "spec.training.algorithm",
     "must be one of downpour, sandblaster"),
    ("unknown-field", _set("spec.workers.replikas", 3), "spec.workers.replikas",
     "unknown field"),
    ("unknown-top-level", _set("specs", {}), "specs", "unknown field"),
    ("source-required", _del("spec.data.source"), "spec.data.source", "required"),
    ("spec-required", _del("spec"), "spec", "required"),
    ("source-pattern", _set("spec.data.source", "s3://bucket/x"), "spec.data.source",
     "must be a data source: builtin:digits, synthetic:"),
    ("builtin-unknown", _set("spec.data.source", "builtin:mnist"), "spec.data.source",
     "known: digits"),
    ("sandblaster-unit-zero", _set("spec.training.sandblaster.workUnitSize", 0),
     "spec.training.sandblaster.workUnitSize", ">= 1"),
    ("synthetic-not-integer",
     _set("spec.data.source", "synthetic:features=x,classes=3,samples=100"),
     "spec.data.source", "features must be an integer"),
    ("synthetic-missing-key", _set("spec.data.source", "synthetic:features=8,classes=3"),
     "spec.data.source", "samples required"),
    ("synthetic-no-equals", _set("spec.data.source", "synthetic:features=8,classes=3,samples"),
     "spec.data.source", "key=value"),
    ("synthetic-unknown-key", _set("spec.data.source",
                                   "synthetic:features=8,classes=3,samples=100,colour=2"),
     "spec.data.source", "unknown parameter"),
    ("synthetic-bounds", _set("spec.data.source", "synthetic:features=8,classes=1,samples=100"),
     "spec.data.source", "classes must be within 2..100000"),
    ("npz-relative", _set("spec.data.source", "npz:data/train.npz"), "spec.data.source",
     "absolute"),
    ("parquet-relative", _set("spec.data.source", "parquet:data/*.parquet"), "spec.data.source", "absolute"),
    ("test-files-of-a-single-source", _set("spec.data.test", "/srv/test.parquet"), "spec.data.test",
     "file source"),
    ("columns-of-a-single-source", _set("spec.data.ids", ["user"]), "spec.data.label", "file source"),
    ("test-fraction-max", _set("spec.data.testFraction", 0.95), "spec.data.testFraction",
     "<= 0.9"),
    ("duration-pattern", _set("spec.training.maxDuration", "10 minutes"),
     "spec.training.maxDuration", "must be a duration: a number with a unit ms, s, m or h, for example 90s"),
    ("duration-zero", _set("spec.training.maxDuration", "0s"), "spec.training.maxDuration",
     "must be > 0"),
    ("name-too-long", _set("metadata.name", "a" * (contract.MAX_JOB_NAME + 1)),
     "metadata.name", f"at most {contract.MAX_JOB_NAME} characters"),
    ("name-uppercase", _set("metadata.name", "Digits"), "metadata.name", "DNS-1035 label"),
    ("name-starts-with-digit", _set("metadata.name", "1job"), "metadata.name", "letter"),
    ("name-required", _del("metadata.name"), "metadata.name", "required"),
    ("metadata-required", _del("metadata"), "metadata", "required"),
    ("namespace-bad", _set("metadata.namespace", "Team_A"), "metadata.namespace", "DNS-1123"),
    ("min-over-max", _set("spec.workers.autoscaling.minReplicas", 5),
     "spec.workers.autoscaling.minReplicas", "must be <= maxReplicas (got 5 > 4)"),
    ("max-required", _del("spec.workers.autoscaling.maxReplicas"),
     "spec.workers.autoscaling.maxReplicas", "required"),
    ("entrypoint-and-type", _set("spec.model.entrypoint", "pkg.mod:build"),
     "spec.model.entrypoint", "not allowed together with spec.model.type"),
    ("entrypoint-pattern", lambda d: d["spec"].update(model={"entrypoint": "not a module"}),
     "spec.model.entrypoint", "must be module:function, for example my_models.mlp:build"),
    ("model-type-enum", _set("spec.model.type", "cnn"), "spec.model.type", "mlp, softmax"),
    ("hidden-layer-minimum", _set("spec.model.hiddenLayers", [32, 0]),
     "spec.model.hiddenLayers[1]", ">= 1"),
    ("hidden-layers-max-items", _set("spec.model.hiddenLayers", [8] * 17),
     "spec.model.hiddenLayers", "at most 16 items"),
    ("image-empty", _set("spec.image", ""), "spec.image", "at least 1 characters"),
    ("retention-enum", _set("spec.parameterServers.checkpoint.storage.retention", "Keep"),
     "spec.parameterServers.checkpoint.storage.retention", "Retain, Delete"),
    ("storage-size", _set("spec.parameterServers.checkpoint.storage.size", "1 GB"),
     "spec.parameterServers.checkpoint.storage.size", "must be a size, for example 1Gi"),
    ("quantity-pattern", _set("spec.parameterServers.resources.requests.cpu", "lots"),
     "spec.parameterServers.resources.requests.cpu", "must be a Kubernetes quantity, for example 500m"),
    ("quantity-float", _set("spec.parameterServers.resources.requests.memory", 1.5),
     "spec.parameterServers.resources.requests.memory", "integer or a string"),
    ("resources-unknown", _set("spec.parameterServers.resources.request", {}),
     "spec.parameterServers.resources.request", "did you mean requests?"),
    ("training-not-object", _set("spec.training", [1]), "spec.training",
     "must be of type object (got array)"),
    ("suspend-int", _set("spec.runPolicy.suspend", 1), "spec.runPolicy.suspend", "boolean"),
    ("metrics-max-items", _set("spec.workers.autoscaling.metrics", [{}] * 17),
     "spec.workers.autoscaling.metrics", "at most 16 items"),
    ("shards-max", _set("spec.parameterServers.shards", 257), "spec.parameterServers.shards",
     "<= 256"),
    ("partitions-zero", _set("spec.model.partitions", 0), "spec.model.partitions", ">= 1"),
    ("partitions-max", _set("spec.model.partitions", 17), "spec.model.partitions", "<= 16"),
    ("partitions-sandblaster", _partitioned(2, spec_training_algorithm="sandblaster"), "spec.model.partitions",
     "partitions > 1 is not supported with sandblaster (got 2); use spec.training.algorithm: downpour"),
    ("partitions-softmax", _partitioned(2, spec_model_type="softmax"), "spec.model.partitions",
     'needs spec.model.type mlp (got "softmax"'),
    ("partitions-entrypoint", lambda d: d["spec"].update(model={"entrypoint": "pkg.mod:build", "partitions": 2}),
     "spec.model.partitions", "needs a built-in mlp: a user model (spec.model.entrypoint) cannot be cut"),
    ("partitions-embeddings", _partitioned(2, spec_model_embeddings={"dim": 4}), "spec.model.partitions",
     "not available with spec.model.embeddings"),
    ("partitions-layers", _partitioned(4, spec_parameterServers_shards=4), "spec.model.partitions",
     "4 partitions need at least 4 layers, and the mlp has 3"),
    ("partitions-shards", _partitioned(3), "spec.model.partitions",
     "3 partitions need at least 3 parameter shards, each partition its own (spec.parameterServers.shards is 2)"),
    ("api-version", _set("apiVersion", "distbelief.io/v1"), "apiVersion",
     "must be distbelief.io/v1alpha1"),
    ("api-version-missing", _del("apiVersion"), "apiVersion", "required"),
    ("kind", _set("kind", "Job"), "kind", f"must be {contract.KIND}"),
    ("status-phase", _set("status.phase", "Done"), "status.phase", "one of"),
    ("backups-too-many", _set("spec.parameterServers.backups", 3), "spec.parameterServers.backups",
     "must be <= 2 (got 3)"),
    ("min-in-sync-above-the-copies", lambda doc: (put(doc, "spec.parameterServers.backups", 1),
                                                  put(doc, "spec.parameterServers.minInSync", 3)),
     "spec.parameterServers.minInSync", "must be at most spec.parameterServers.backups + 1 (the copies of each "
     "shard); got 3 with backups 1"),
    ("min-in-sync-without-backups", _set("spec.parameterServers.minInSync", 2), "spec.parameterServers.minInSync",
     "got 2 with backups 0"),
    ("backups-sandblaster", lambda doc: (put(doc, "spec.parameterServers.backups", 1),
                                         put(doc, "spec.training.algorithm", "sandblaster")),
     "spec.parameterServers.backups", "not available with spec.training.algorithm: sandblaster"),
    ("backups-expiring-rows", lambda doc: (put(doc, "spec.parameterServers.backups", 1),
                                           put(doc, "spec.model.embeddings", {"dim": 4, "expireAfterSeconds": 60})),
     "spec.parameterServers.backups", "not available with spec.model.embeddings.expireAfterSeconds"),
    ("journal-with-backups", lambda doc: (put(doc, "spec.parameterServers.backups", 1),
                                          put(doc, "spec.parameterServers.journal", True)),
     "spec.parameterServers.journal", "not available with spec.parameterServers.backups > 0"),
    ("journal-sandblaster", lambda doc: (put(doc, "spec.parameterServers.journal", True),
                                         put(doc, "spec.training.algorithm", "sandblaster")),
     "spec.parameterServers.journal", "not available with spec.training.algorithm: sandblaster"),
    ("journal-not-boolean", _set("spec.parameterServers.journal", "yes"), "spec.parameterServers.journal",
     "boolean"),
    ("wire-format-enum", _set("spec.parameterServers.wireFormat", "float16"), "spec.parameterServers.wireFormat",
     "must be one of float32, bfloat16"),
    ("wire-format-sandblaster", _bfloat16(spec_training_algorithm="sandblaster"), "spec.parameterServers.wireFormat",
     "bfloat16 is not available with spec.training.algorithm: sandblaster"),
    ("wire-format-embeddings", _bfloat16(spec_model_embeddings={"dim": 4}), "spec.parameterServers.wireFormat",
     "bfloat16 is not available with spec.model.embeddings"),
    ("wire-format-partitions", _bfloat16(spec_model_partitions=2), "spec.parameterServers.wireFormat",
     "bfloat16 is not available with spec.model.partitions > 1"),
    ("overlap-not-boolean", _set("spec.training.overlap", "yes"), "spec.training.overlap", "boolean"),
    ("micro-batches-zero", _partitioned(2, spec_model_microBatches=0), "spec.model.microBatches", ">= 1"),
    ("micro-batches-max", _partitioned(2, spec_model_microBatches=65), "spec.model.microBatches", "<= 64"),
    ("micro-batches-unpartitioned", _set("spec.model.microBatches", 4), "spec.model.microBatches",
     "micro-batches above 1 need spec.model.partitions > 1"),
    ("micro-batches-batch", _partitioned(2, spec_model_microBatches=8, spec_training_batchSize=4),
     "spec.model.microBatches", "8 micro-batches need a minibatch of at least 8 rows"),
    ("overlap-push-every", _overlapped(spec_training_pushEvery=4), "spec.training.overlap",
     "needs spec.training.fetchEvery and pushEvery 1"),
    ("overlap-sandblaster", _overlapped(spec_training_algorithm="sandblaster"), "spec.training.overlap",
     "not available with spec.training.algorithm: sandblaster"),
    ("overlap-embeddings", _overlapped(spec_model_embeddings={"dim": 4}), "spec.training.overlap",
     "not available with spec.model.embeddings"),
    ("overlap-partitions", _overlapped(spec_model_partitions=2), "spec.training.overlap",
     "not available with spec.model.partitions > 1"),
    ("overlap-synchronous", _overlapped(spec_training_maxStaleness=0), "spec.training.overlap",
     "needs spec.training.maxStaleness of at least 1"),
]


@pytest.mark.parametrize("mutate, path, rule", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_manifest_gives_one_line_naming_the_field(
    mutate: Callable[[dict[str, Any]], None], path: str, rule: str
) -> None:
    doc = good()
    mutate(doc)
    errors = errors_of(doc)
    assert len(errors) == 1, errors
    (line,) = errors
    assert "\n" not in line
    assert line.startswith(f"{path}: "), line
    assert rule in line, line


def test_the_bad_table_is_big_enough() -> None:
    assert len(BAD) >= 30
    assert len({b[0] for b in BAD}) == len(BAD)


@pytest.mark.parametrize("mutate, path, rule", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_manifest_is_refused_by_the_validate_command(
    mutate: Callable[[dict[str, Any]], None], path: str, rule: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = good()
    mutate(doc)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    code = cli.main(["validate", str(job_file)])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_INVALID
    assert "valid" not in out
    lines = err.strip().splitlines()
    assert lines == [f"{job_file}: {errors_of(doc)[0]}"]
    assert lines[0].startswith(f"{job_file}: {path}: ") and rule in lines[0]


def test_the_validate_command_accepts_the_good_fixture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(good()))
    assert cli.main(["validate", str(job_file)]) == 0
    assert capsys.readouterr().out.strip() == f"{job_file}: valid"


# Rows of BAD that the CRD's openAPIV3Schema refuses by itself, so the API server turns
# them away before the operator sees them. The others (unknown fields, which a structural
# schema prunes rather than refuses; metadata and identity checks; cross-field and
# data-source rules) are caught by `distbelief validate` and the operator only.
SCHEMA_REFUSES = {
    "batch-too-big", "backups-too-many", "batch-zero", "batch-bool", "batch-fraction", "lr-string",
    "lr-exclusive-minimum", "optimizer-enum", "algorithm-enum", "source-required",
    "spec-required", "source-pattern", "test-fraction-max", "duration-pattern",
    "max-required", "entrypoint-pattern", "model-type-enum", "hidden-layer-minimum",
    "hidden-layers-max-items", "image-empty", "retention-enum", "storage-size",
    "quantity-pattern", "quantity-float", "training-not-object", "suspend-int", "journal-not-boolean",
    "metrics-max-items", "shards-max", "status-phase", "sandblaster-unit-zero", "partitions-zero",
    "partitions-max", "wire-format-enum", "overlap-not-boolean", "micro-batches-zero", "micro-batches-max",
}


def _schema_error_paths(doc: Mapping[str, Any]) -> list[str]:
    """Where the CRD schema, read as JSON Schema (draft 4 has OpenAPI's boolean
    exclusiveMinimum), finds doc wrong; a missing required field is named itself."""
    validator = jsonschema.Draft4Validator(spec.openapi_schema())
    paths = []
    for error in validator.iter_errors(doc):
        where = ".".join(str(p) for p in error.absolute_path)
        if error.validator == "required":
            missing = str(error.message).split("'")[1]
            where = f"{where}.{missing}" if where else missing
        paths.append(re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", where))
    return paths


@pytest.mark.parametrize("mutate, path", [b[1:3] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_manifest_against_the_crd_schema(
    mutate: Callable[[dict[str, Any]], None], path: str, request: pytest.FixtureRequest
) -> None:
    doc = good()
    assert _schema_error_paths(doc) == []
    mutate(doc)
    name = request.node.callspec.id
    if name in SCHEMA_REFUSES:
        assert _schema_error_paths(doc) == [path]
    else:  # a rule only the validator knows: keep the list above honest
        assert _schema_error_paths(doc) == []


def test_schema_refuses_names_rows_of_the_table() -> None:
    assert SCHEMA_REFUSES <= {b[0] for b in BAD}
    assert len(SCHEMA_REFUSES) >= 25


def test_all_problems_are_reported_together() -> None:
    doc = good()
    doc["spec"]["training"]["batchSize"] = 0
    doc["spec"]["workers"]["replikas"] = 1
    doc["spec"]["data"]["source"] = "builtin:mnist"
    doc["metadata"]["name"] = "Bad"
    errors = errors_of(doc)
    assert len(errors) == 4, errors
    for path in ("spec.training.batchSize", "spec.workers.replikas", "spec.data.source",
                 "metadata.name"):
        assert sum(e.startswith(path + ":") for e in errors) == 1, (path, errors)


def test_each_synthetic_problem_is_its_own_line() -> None:
    doc = good()
    doc["spec"]["data"]["source"] = "synthetic:features=0,classes=x"
    errors = errors_of(doc)
    assert len(errors) == 3, errors  # features out of bounds, classes not int, samples missing
    assert all(e.startswith("spec.data.source: synthetic: ") for e in errors)


def test_not_a_mapping() -> None:
    assert errors_of(["a"]) == ["manifest: must be a mapping (got array)"]


def test_pattern_end_anchor_means_end_of_text() -> None:
    doc = good()
    doc["spec"]["model"] = {"entrypoint": "pkg.mod:build\n"}
    assert errors_of(doc)[0].startswith("spec.model.entrypoint: must be module:function")


def test_name_length_message_says_why() -> None:
    doc = good()
    doc["metadata"]["name"] = "a" * 60
    (line,) = errors_of(doc)
    assert f"{contract.PS_SUFFIX}-<i>" in line and str(contract.DNS_LABEL_MAX) in line


def test_longest_allowed_name_is_fine() -> None:
    doc = good()
    doc["metadata"]["name"] = "a" * contract.MAX_JOB_NAME
    spec.validate_job(doc)


# ------------------------------------------------------------------ parse_synthetic


def test_parse_synthetic() -> None:
    assert contract.synthetic_params("features=8,classes=3,samples=100") == \
        ({"features": 8, "classes": 3, "samples": 100, "seed": 0}, [])
    assert contract.synthetic_params("features=8, classes=3, samples=100, seed=7")[0]["seed"] == 7


@pytest.mark.parametrize("source, problem", [
    ("features=8", "classes required"), ("features=8,classes=3,samples=1e3", "samples must be an integer"),
    ("features=8,classes=3,samples=100,features=9", "features given twice"),
    ("features=8,classes=3,samples=100000000", "samples must be within"),
])
def test_parse_synthetic_rejects(source: str, problem: str) -> None:
    _, problems = contract.synthetic_params(source)
    assert any(problem in p for p in problems), problems


# --------------------------------------------------------------------- job_config


def test_job_config_resolves_name_namespace_and_spec() -> None:
    job = spec.validate_job(good())
    config = spec.job_config(job)
    assert (config.name, config.namespace) == ("good", "team-a")
    assert config.written == job["spec"]
    assert config.spec.parameter_servers.shards == 2
    bare = spec.job_config(spec.validate_job(MINIMAL), namespace_default="ns")
    assert bare.namespace == "ns"
    assert contract.JobConfig.from_json(config.to_json()) == config


# ---------------------------------------------------------------- load_manifests


def test_load_manifests_reads_every_document_and_skips_empty_ones(tmp_path: Path) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text("---\n" + yaml.safe_dump(MINIMAL) + "---\n---\n# nothing\n---\n"
                    + yaml.safe_dump(good()))
    docs = spec.load_manifests(str(path))
    assert [d["metadata"]["name"] for d in docs] == ["mini", "good"]


def test_load_manifests_reports_yaml_errors_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("apiVersion: distbelief.io/v1alpha1\nspec:\n  data: [unclosed\n")
    with pytest.raises(SpecError) as caught:
        spec.load_manifests(str(path))
    (line,) = caught.value.errors
    assert str(path) in line and "line " in line and "\n" not in line


def test_load_manifests_rejects_documents_that_are_not_mappings(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("just some words\n---\n- a\n- b\n")
    with pytest.raises(SpecError) as caught:
        spec.load_manifests(str(path))
    assert len(caught.value.errors) == 2
    assert all(str(path) in e and "must be a mapping" in e for e in caught.value.errors)


def test_load_manifests_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        spec.load_manifests(str(tmp_path / "absent.yaml"))


def test_load_manifests_binary_file(tmp_path: Path) -> None:
    path = tmp_path / "blob.yaml"
    path.write_bytes(b"\xff\xfe\x00\x01binary")
    with pytest.raises(SpecError, match=str(path.name)):
        spec.load_manifests(str(path))


# --------------------------------------------------------------------- the CRD


def test_load_crd_is_the_file_in_crds() -> None:
    assert spec.load_crd() == yaml.safe_load(CRD_FILE.read_text())


def test_crd_env_var_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    version = crd["spec"]["versions"][0]
    batch = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "training"]["properties"]["batchSize"]
    batch["default"] = 48
    training = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "training"]["properties"]
    training["targetLoss"]["nullable"] = True
    path = tmp_path / "crd.yaml"
    path.write_text(yaml.safe_dump(crd))
    monkeypatch.setenv(spec.CRD_ENV, str(path))
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["training"] = {"targetLoss": None}
    assert spec.validate_job(doc)["spec"]["training"] == {
        **spec.validate_job(MINIMAL)["spec"]["training"], "targetLoss": None}
    assert spec.validate_job(MINIMAL)["spec"]["training"]["batchSize"] == 48
    monkeypatch.delenv(spec.CRD_ENV)
    assert spec.validate_job(MINIMAL)["spec"]["training"]["batchSize"] == 32
    assert "targetLoss" not in spec.validate_job(doc)["spec"]["training"]  # pruned null


def test_a_crd_with_an_unsupported_keyword_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "oneOf"] = [{"required": ["data"]}]
    path = tmp_path / "crd.yaml"
    path.write_text(yaml.safe_dump(crd))
    monkeypatch.setenv(spec.CRD_ENV, str(path))
    with pytest.raises(RuntimeError, match="spec: oneOf"):
        spec.validate_job(MINIMAL)


def test_crd_is_a_valid_custom_resource_definition() -> None:
    kubernetes_validate.validate(spec.load_crd(), K8S_VERSION, strict=True)


def test_crd_names_and_subresources() -> None:
    crd = spec.load_crd()
    assert crd["metadata"]["name"] == f"{contract.PLURAL}.{contract.API_GROUP}"
    assert crd["spec"]["group"] == contract.API_GROUP
    assert crd["spec"]["names"]["kind"] == contract.KIND
    assert "dbj" in crd["spec"]["names"]["shortNames"]
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == contract.API_VERSION]
    assert version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.workers.replicas",
        "statusReplicasPath": ".status.workers.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    for name in ("Phase", "Workers", "Shards", "Step", "Progress", "ETA", "Loss", "Accuracy", "Age"):
        assert name in columns


def test_crd_uses_only_keywords_the_validator_supports() -> None:
    def keywords(schema: Mapping[str, Any]) -> Iterator[str]:
        yield from schema
        for sub in schema.get("properties", {}).values():
            yield from keywords(sub)
        for key in ("items", "additionalProperties"):
            if isinstance(schema.get(key), Mapping):
                yield from keywords(schema[key])
        for branch in schema.get("anyOf", []):
            yield from keywords(branch)

    assert set(keywords(spec.openapi_schema())) <= spec.SUPPORTED_KEYWORDS


CONSTRAINTS = ("default", "enum", "minimum", "maximum", "pattern", "maxLength",
               "maxItems", "maxProperties")
# Leaves of spec that are deliberately free, each with its reason: a role template's
# affinity is a core/v1 Affinity, which the API server checks when it creates the pods; the
# fields the operator owns are declared only so that a rule can refuse them by name.
UNCONSTRAINED_LEAVES: set[str] = {
    f"spec.{role}.template.spec.{field}" for role in templates.ROLE_KEYS.values()
    for field in ("affinity", *templates.OWNED_POD_FIELDS,
                  *(f"containers[*].{f}" for f in templates.OWNED_CONTAINER_FIELDS))}


def _leaves(schema: Mapping[str, Any], path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    if "properties" in schema:
        for name, sub in schema["properties"].items():
            yield from _leaves(sub, f"{path}.{name}")
    elif isinstance(schema.get("additionalProperties"), Mapping):
        yield from _leaves(schema["additionalProperties"], f"{path}.*")
    else:
        yield path, schema
        if isinstance(schema.get("items"), Mapping) and "properties" in schema["items"]:
            yield from _leaves(schema["items"], f"{path}[*]")


def test_every_leaf_of_spec_is_typed_and_constrained() -> None:
    leaves = list(_leaves(schema_at("spec"), "spec"))
    assert len(leaves) > 40
    for path, leaf in leaves:
        assert "type" in leaf or leaf.get("x-kubernetes-int-or-string"), path
        if path in UNCONSTRAINED_LEAVES:
            continue
        assert any(k in leaf for k in CONSTRAINTS), f"{path} has no default or bound"


def test_validation_is_idempotent_so_the_defaults_are_valid() -> None:
    # The API server refuses a CRD whose defaults do not validate; so does this check.
    job = spec.validate_job(MINIMAL)
    doc = copy.deepcopy(job)
    assert spec.validate_job(doc) == job


def test_an_autoscaler_behavior_takes_scale_up_and_scale_down_and_no_third_field() -> None:
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["workers"] = {"autoscaling": {"maxReplicas": 4, "behavior": {
        "scaleUp": {"stabilizationWindowSeconds": 0}, "scaleDown": {"stabilizationWindowSeconds": 30}}}}
    assert spec.validate_job(doc)["spec"]["workers"]["autoscaling"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 30}
    doc["spec"]["workers"]["autoscaling"]["behavior"]["scaleSideways"] = {}
    assert errors_of(doc) == ["spec.workers.autoscaling.behavior: must have at most 2 fields (got 3)"]


def test_a_stored_job_under_a_newer_crd_has_its_unknown_fields_dropped_and_named() -> None:
    """The operator reads jobs the API server pruned to its CRD: a field this code does not
    know came with a newer CRD, and is dropped (and named), not a reason to fail the job."""
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["training"] = {"futureKnob": True, "maxSteps": 50}
    assert errors_of(copy.deepcopy(doc)) == ["spec.training.futureKnob: unknown field"]
    pruned: list[str] = []
    job = spec.validate_job(doc, pruned=pruned)
    assert pruned == ["spec.training.futureKnob"]
    assert "futureKnob" not in job["spec"]["training"] and job["spec"]["training"]["maxSteps"] == 50
