"""The typed job (distbelief.runtime.jobspec): generated from the CRD by tools/gen-jobspec,
resolved once from the spec the ConfigMap holds, with the CRD's defaults; the only runtime
module that reads the CRD's keys; and the one derivation of data, model and layout
(model/job.py) that the roles, local mode's checks and predict share."""

from __future__ import annotations

import ast
import dataclasses
import json
import runpy
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from distbelief.operator.local import preflight
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract, errors, jobbase, jobresolve, jobspec
from distbelief.runtime.model.job import Job

from support.examples import load_example
from support.filejobs import CTR_FIELDS, sparse_job, write_ctr_parquet
from support.paths import EXAMPLES, REPO

RUNTIME = REPO / "runtime" / "distbelief" / "runtime"
CRD = REPO / "crds" / "distbelief.io_distbeliefjobs.yaml"
CLASSES, RESOLVER = RUNTIME / "jobspec", RUNTIME / "jobresolve.py"
GENERATOR = REPO / "tools" / "gen-jobspec"
MINIMAL = {"apiVersion": contract.JOB_API_VERSION, "kind": contract.KIND, "metadata": {"name": "tiny"},
           "spec": {"data": {"source": "builtin:digits"}}}


def _crd_keys(schema: dict[str, Any]) -> Iterator[str]:
    for name, sub in schema.get("properties", {}).items():
        yield name
        yield from _crd_keys(sub)
        if isinstance(sub.get("items"), dict):
            yield from _crd_keys(sub["items"])


def spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def crd_keys() -> set[str]:
    """Every camelCase key of the CRD's spec (the ones no other name in the code shares)."""
    return {key for key in _crd_keys(spec_schema(yaml.safe_load(CRD.read_text(encoding="utf-8")))) if key != key.lower()}


def generated(crd_text: str) -> dict[Path, str]:
    """What tools/gen-jobspec writes for a CRD, in memory: each module's text by its path."""
    generator = runpy.run_path(str(GENERATOR))
    return generator["generate"](crd_text, generator["hand_written_bases"]())


def test_the_typed_job_is_what_the_generator_makes_of_the_crd() -> None:
    fresh = generated(CRD.read_text(encoding="utf-8"))
    assert set(fresh) == set(CLASSES.glob("*.py")) | {RESOLVER}, "jobspec/ has modules to add or remove: run tools/gen-jobspec"
    for path, text in fresh.items():
        assert path.read_text(encoding="utf-8") == text, f"{path.name} is stale: run tools/gen-jobspec"


def test_a_field_added_to_the_crd_reaches_the_typed_job_with_its_type_default_and_description() -> None:
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    training = spec_schema(crd)["properties"]["training"]["properties"]
    training["warmupSeconds"] = {"type": "number", "default": 5, "description": "Seconds of warm-up."}
    training["schedule"] = {"type": "object", "description": "The rate's schedule.",
                            "properties": {"decayEvery": {"type": "integer"}}}
    texts = generated(yaml.safe_dump(crd, sort_keys=False))
    classes, resolver = texts[CLASSES / "training.py"], texts[RESOLVER]
    assert 'warmup_seconds: float = 5.0\n    """Seconds of warm-up."""' in classes
    assert 'warmup_seconds=at.get("warmupSeconds", jobbase.number, 5.0),' in resolver
    assert 'class Schedule:\n    """spec.training.schedule: The rate\'s schedule."""' in classes
    assert "schedule: Schedule | None = None" in classes and "decay_every: int | None = None" in classes
    assert 'schedule=at.optional("schedule", _schedule),' in resolver


def test_properties_the_roles_share_are_declared_once() -> None:
    classes = "".join(generated(CRD.read_text(encoding="utf-8")).values())
    assert classes.count("    resources: Mapping[str, Any]") == 1 and classes.count("    template: Mapping") == 1
    assert jobspec.Workers().resources == {} and jobspec.ParameterServers(resources={"a": 1}).resources == {"a": 1}
    assert issubclass(jobspec.Workers, jobspec.Role) and issubclass(jobspec.ParameterServers, jobspec.Role)


def test_the_typed_defaults_are_the_crds() -> None:
    """What validate_job fills in resolves to exactly the dataclasses' defaults, so a
    value built in code (or a config from before a field) agrees with the CRD."""
    resolved = jobresolve.resolve(spec.validate_job(MINIMAL)["spec"])
    assert resolved == jobspec.JobSpec(data=jobspec.Data(source="builtin:digits"))
    with_rows = dict(MINIMAL, spec={"data": {"source": "synthetic-ctr:fields=2,ids=50,samples=100"},
                                    "model": {"embeddings": {}}})
    assert jobresolve.resolve(spec.validate_job(with_rows)["spec"]).model.embeddings == jobspec.Embeddings()


def test_an_example_resolves_to_the_values_it_gives() -> None:
    resolved = spec.job_config(spec.validate_job(load_example("ctr-sparse.yaml"))).spec
    assert resolved.model.embeddings == jobspec.Embeddings(dim=8, hash_buckets=0, admit_after=1,
                                                           expire_after_seconds=3600.0)
    assert resolved.model.hidden_layers == () and jobbase.as_spec(resolved.model)["embeddings"]["dim"] == 8
    assert (resolved.training.batch_size, resolved.training.learning_rate) == (256, 0.01)
    assert resolved.training.max_duration_seconds == 300.0 and resolved.training.max_staleness is None
    assert (resolved.parameter_servers.shards, resolved.parameter_servers.checkpoint.every_seconds) == (2, 10.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.training.batch_size = 1  # type: ignore[misc]


@pytest.mark.parametrize("spec_dict, problem", [
    ({"data": {}}, "spec.data.source: required"),
    ({"data": {"source": "builtin:digits"}, "training": {"learningRate": "fast"}},
     "spec.training.learningRate: must be a number"),
    ({"data": {"source": "builtin:digits"}, "parameterServers": {"shards": 1.5}},
     "spec.parameterServers.shards: must be an integer"),
    ({"data": {"source": "builtin:digits"}, "training": {"maxDuration": "soon"}},
     "spec.training.maxDuration: not a duration"),
    ({"data": {"source": "builtin:digits"}, "model": {"hiddenLayers": ["64"]}},
     "spec.model.hiddenLayers: must be a list of integers"),
    ({"data": {"source": "builtin:digits"}, "model": []}, "spec.model: must be a mapping"),
])
def test_a_config_the_resolver_cannot_read_names_the_field(spec_dict: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        jobresolve.resolve(spec_dict)


def test_the_configmap_still_holds_the_spec_as_a_dict(tmp_path: Path) -> None:
    """The typed job is derived on both sides; the file the pods read is unchanged."""
    config = spec.job_config(spec.validate_job(MINIMAL))
    doc = json.loads(config.to_json())
    assert set(doc) == {"apiVersion", "kind", "name", "namespace", "spec"}
    assert doc["spec"] == spec.validate_job(MINIMAL)["spec"]
    (tmp_path / "job.json").write_text(config.to_json())
    assert contract.JobConfig.load(str(tmp_path / "job.json")).spec == config.spec


def test_no_runtime_module_but_the_resolver_names_a_crd_key() -> None:
    keys = crd_keys()
    assert {"learningRate", "hiddenLayers", "fetchEvery", "maxEvalExamples", "expireAfterSeconds"} <= keys
    found = []
    for path in sorted(RUNTIME.rglob("*.py")):
        if path == RESOLVER:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in keys:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not found, "CRD keys read outside jobspec.resolve:\n" + "\n".join(found)


def test_the_scan_sees_a_key() -> None:
    assert "learningRate" in {n.value for n in ast.walk(ast.parse('spec["training"]["learningRate"]'))
                              if isinstance(n, ast.Constant)}


@pytest.mark.parametrize("name", sorted(p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*.yaml")))
def test_local_mode_checks_derive_the_model_and_layout_the_roles_do(name: str, monkeypatch) -> None:
    """Preflight's layout hash is the one the shards' checkpoints carry: the same Job."""
    monkeypatch.syspath_prepend(str(EXAMPLES / "usercode"))
    job = spec.validate_job(load_example(name))
    derived = Job(spec.job_config(job))
    checked = preflight.check(DistBeliefJob.of(job))
    assert checked.layout.hash == derived.layout.hash
    assert checked.shapes == [(n, tuple(s)) for n, s in derived.model.shapes]
    embeddings = derived.spec.model.embeddings
    if embeddings is not None:  # the MLP takes the dense features and a row per id field
        first_layer = derived.model.shapes[0][1]
        assert first_layer[0] == derived.dataset.n_features + derived.dataset.fields * embeddings.dim


def test_file_sources_stream_under_downpour_with_or_without_embeddings() -> None:
    files, embeddings = jobspec.Data(source="parquet:/d/*.parquet", ids=("c0",)), jobspec.Model(embeddings=jobspec.Embeddings())
    assert jobspec.JobSpec(data=files).streams_data and jobspec.JobSpec(data=files, model=embeddings).streams_data
    sandblaster = jobspec.Training(algorithm="sandblaster")
    assert not jobspec.JobSpec(data=files, model=embeddings, training=sandblaster).streams_data   # loads it whole
    ctr = jobspec.Data(source="synthetic-ctr:fields=2,ids=10,samples=100")
    assert not jobspec.JobSpec(data=ctr, model=embeddings).streams_data


def test_a_streaming_job_with_embeddings_is_shaped_by_its_files_and_holds_only_the_held_out_part(tmp_path: Path) -> None:
    write_ctr_parquet(tmp_path / "d", files=4, per_file=100, group=50)
    doc = spec.validate_job(sparse_job(f"parquet:{tmp_path}/d/*.parquet", test=f"{tmp_path}/d/part-03.parquet"))
    derived = Job(spec.job_config(doc))
    assert derived.files is not None and len(derived.files.train_units) == 6
    dim = derived.spec.model.embeddings.dim
    assert derived.model.shapes[0][1][0] == 1 + CTR_FIELDS * dim   # the column `noise`, then a row per id field
    assert derived.data_bytes(1) == 0                               # a shard but the chief's holds no data
    assert derived.data_bytes(0) == derived.dataset.nbytes > 0
    assert len(derived.dataset.y_train) == 0 and derived.dataset.ids_test.shape == (100, CTR_FIELDS)
    checked = preflight.check(DistBeliefJob.of(doc))
    assert (checked.examples, checked.features, checked.classes) == (400, 1, 2)
    held_out = pq.read_table(tmp_path / "d" / "part-03.parquet").to_pydict()
    held_out["c2"][7] = -5
    pq.write_table(pa.table(held_out), tmp_path / "d" / "part-03.parquet", row_group_size=50)
    with pytest.raises(errors.BadData, match=r"part-03.parquet row group 0: id column 'c2' must hold integers"):
        preflight.check(DistBeliefJob.of(doc))   # the held-out ids are checked before any pod starts
