"""Validation as a user meets it: files YAML reads surprisingly, hints beside the rules,
a warning for a model too large for its pods, and global options anywhere."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from distbelief.operator.errors import SpecError
from distbelief.operator.render import sizing
from distbelief.operator.validation import spec
from distbelief.runtime import jobspec

from support.cli import run_cli
from support.examples import load_example
from support.paths import EXAMPLES, REPO

JOB_TEXT = (EXAMPLES / "digits-mlp.yaml").read_text()


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n---\n"])
def test_an_empty_file_is_an_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    done = run_cli("validate", str(path))
    assert done.returncode == 2
    assert done.stderr.strip() == f"{path}: {path}: holds no manifest (the file is empty or only comments)"


def test_a_duplicate_key_is_an_error_naming_its_line(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(JOB_TEXT.replace("    batchSize: 32\n", "    batchSize: 32\n    batchSize: 64\n"))
    with pytest.raises(SpecError) as caught:
        spec.load_manifests(str(path))
    (line,) = caught.value.errors
    assert "duplicate key 'batchSize'" in line and "line 14" in line and str(path) in line


def test_a_kubectl_list_is_unpacked_into_its_items(tmp_path: Path) -> None:
    job = load_example("digits-mlp.yaml")
    other = copy.deepcopy(job)
    other["metadata"]["name"] = "digits-two"
    path = tmp_path / "list.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [job, other]}))
    assert [d["metadata"]["name"] for d in spec.load_manifests(str(path))] == ["digits", "digits-two"]
    done = run_cli("validate", str(path))
    assert done.returncode == 0 and done.stdout.strip() == f"{path}: valid", done.stderr


def test_a_number_yaml_reads_as_text_gets_a_hint(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB_TEXT.replace("learningRate: 0.05", "learningRate: 1e-3"))
    done = run_cli("validate", str(path))
    assert done.returncode == 2
    assert done.stderr.strip() == (f'{path}: spec.training.learningRate: must be of type number (got string "1e-3"); '
                                   "YAML 1.1 reads 1e-3 as text: write 1.0e-03 or 0.001, unquoted")


def test_patterns_are_explained_with_a_valid_example() -> None:
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["training"]["maxDuration"] = "10 minutes"
    doc["spec"]["workers"]["resources"]["limits"]["memory"] = "1 GB"
    with pytest.raises(SpecError) as caught:
        spec.validate_job(doc)
    assert sorted(caught.value.errors) == [
        'spec.training.maxDuration: must be a duration: a number with a unit ms, s, m or h, for example 90s, '
        '30m, 2h or 1h30m (got "10 minutes")',
        'spec.workers.resources.limits.memory: must be a Kubernetes quantity, for example 500m or 2 (CPUs), '
        '256Mi or 1Gi (bytes) (got "1 GB")',
    ]
    assert not any("^" in line or "[0-9]" in line for line in caught.value.errors)


def test_a_model_too_large_for_its_pods_is_a_warning_not_an_error(tmp_path: Path) -> None:
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["model"]["hiddenLayers"] = [65536, 65536, 65536]
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(doc))
    done = run_cli("validate", str(path))
    assert done.returncode == 0 and done.stdout.strip() == f"{path}: valid"
    warnings = done.stderr.strip().splitlines()
    assert len(warnings) == 2
    assert warnings[0].startswith(f"{path}: warning: spec.parameterServers.resources.limits.memory: 1Gi is likely "
                                  "too small: each shard holds 4 float32 arrays of its 4,297,490,437 parameters")
    assert warnings[1].startswith(f"{path}: warning: spec.workers.resources.limits.memory: 1Gi is likely too small")
    assert run_cli("validate", str(EXAMPLES / "digits-mlp.yaml")).stderr == ""


def test_parameter_count_from_the_spec_matches_the_built_model() -> None:
    from distbelief.runtime.model import models
    from distbelief.runtime.model.job import Job

    config = spec.job_config(spec.validate_job(load_example("digits-mlp.yaml")))
    assert sizing.parameter_count(config.spec) == models.num_params(Job(config).model)


def test_log_level_is_accepted_after_the_subcommand() -> None:
    done = run_cli("validate", "--log-level", "debug", str(EXAMPLES / "digits-mlp.yaml"))
    assert done.returncode == 0, done.stderr
    assert "DEBUG" in done.stderr
    assert run_cli("--log-level", "warning", "validate", str(EXAMPLES / "digits-mlp.yaml")).returncode == 0


def test_the_name_rule_is_stated_as_the_docs_state_it() -> None:
    doc = load_example("digits-mlp.yaml")
    doc["metadata"]["name"] = "1digits"
    with pytest.raises(SpecError) as caught:
        spec.validate_job(doc)
    (line,) = caught.value.errors
    assert "must be a DNS-1035 label" in line and "starting with a letter" in line
    for doc in ("troubleshooting.md", "reference.md"):
        assert "must be a DNS-1035 label" in (REPO / "docs" / doc).read_text()


def test_a_sandblaster_shard_counts_its_l_bfgs_history() -> None:
    doc = load_example("digits-sandblaster.yaml")
    doc["spec"]["parameterServers"]["resources"] = {"limits": {"memory": "1Mi"}}
    typed = spec.job_config(spec.validate_job(doc)).spec
    history = typed.training.sandblaster.history_size
    (line,) = [w for w in sizing.memory_warnings(typed, 100_000) if "parameterServers" in w]
    assert f"each shard holds {4 + 2 * history} float32 arrays" in line


def test_a_partitioned_replica_s_pods_are_sized_for_their_share_of_the_model() -> None:
    def typed(memory: str) -> jobspec.JobSpec:
        doc = load_example("digits-partitioned.yaml")
        doc["spec"]["workers"]["resources"] = {"limits": {"memory": memory}}
        return spec.job_config(spec.validate_job(doc)).spec

    (line,) = [w for w in sizing.memory_warnings(typed("1Mi"), 1_000_000) if "workers" in w]
    assert "at least 500,000 parameters (the model's 1,000,000 over 2 partitions)" in line and "(about 6 MiB)" in line
    # enough for half, not for the whole
    assert not [w for w in sizing.memory_warnings(typed("7Mi"), 1_000_000) if "workers" in w]


def test_run_and_predict_take_one_job_per_file(tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(JOB_TEXT + "---\n" + JOB_TEXT.replace("name: digits", "name: digits-two"))
    for command in ("run", "predict"):
        done = run_cli(command, str(path))
        assert done.returncode == 2
        assert done.stderr.strip() == f"error: {path}: distbelief {command} takes one DistBeliefJob per file, found 2 documents"


def test_every_pattern_of_the_crd_is_explained_with_an_example() -> None:
    """A pattern the CRD gains without an explanation would show users a raw regex."""
    from distbelief.operator.validation import schemawalk

    def patterns(node: object) -> set[str]:
        if isinstance(node, dict):
            found = {node["pattern"]} if isinstance(node.get("pattern"), str) else set()
            return found.union(*(patterns(v) for v in node.values()))
        if isinstance(node, list):
            return set().union(*(patterns(v) for v in node))
        return set()

    missing = patterns(spec.openapi_schema()) - set(schemawalk.PATTERN_RULES)
    assert not missing, f"patterns without an explanation: {sorted(missing)}"
