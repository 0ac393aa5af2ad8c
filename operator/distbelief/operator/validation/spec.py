"""Validation of DistBeliefJob manifests, driven by the CustomResourceDefinition file.

The CRD in ``crds/`` is the one source of truth of the job schema; this module never
restates it. It reads the CRD's structural ``openAPIV3Schema`` and, like the API
server, applies its defaults and checks its rules (types, bounds, enums, patterns,
required and unknown fields). On top of that it checks what an OpenAPI schema cannot
say: name lengths that derived child names must fit, min <= max, mutually exclusive
fields, the data-source grammar and durations. Every problem is reported as one line,
``<json path>: <rule>``, and all of them together in one :class:`errors.SpecError`.
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import logging
import os
import posixpath
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from distbelief.operator import errors
from distbelief.operator.validation.manifests import load_manifests, load_single
from distbelief.operator.validation.schemawalk import Problems, Walker, at_path, got, join, kind, show
from distbelief.operator.validation.servers import check_servers
from distbelief.operator.validation.templates import check_templates
from distbelief.runtime import contract, jobbase

__all__ = ["load_manifests", "load_single", "validate_job", "job_config", "load_crd", "openapi_schema"]

log = logging.getLogger(__name__)

CRD_ENV = "DISTBELIEF_CRD"
CRD_PACKAGE = "distbelief.operator"
CRD_RESOURCE = "crds/distbelief.io_distbeliefjobs.yaml"

DATA_DIR = "/data"  # where the renderer mounts spec.data.volume
FILE_SCHEMES = ("npz", "npy", "parquet", "csv")  # sources read from files in the pod

# Every schema keyword the validator understands. A CRD using any other keyword is
# refused at load time, so that no rule is ever skipped silently. The CRD's CEL rules
# (x-kubernetes-validations) are this module's rules that a schema cannot say, written
# again for the API server; tests/cluster/test_cluster_validation.py shows the two agree on
# every rule's examples. The list keywords describe status only.
SUPPORTED_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "enum",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
    "maxLength", "pattern", "minItems", "maxItems", "maxProperties", "default", "nullable", "anyOf",
    "format", "description", "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-validations",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
})

# Services and StatefulSets need RFC 1035 labels (start with a letter); namespaces are
# RFC 1123 labels (may start with a digit).
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?\Z")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")


# --------------------------------------------------------------------------- CRD


def load_crd() -> dict[str, Any]:
    """The CRD as a dict: ``$DISTBELIEF_CRD`` if set, else the copy shipped in the package."""
    return copy.deepcopy(_cached_crd(os.environ.get(CRD_ENV) or None))


def openapi_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the served version (v1alpha1) of the CRD."""
    return copy.deepcopy(_schema())


def _schema() -> dict[str, Any]:
    return _cached_schema(os.environ.get(CRD_ENV) or None)


@functools.lru_cache(maxsize=8)
def _cached_crd(override: str | None) -> dict[str, Any]:
    if override:
        text, origin = Path(override).read_text(encoding="utf-8"), override
    else:
        ref = importlib.resources.files(CRD_PACKAGE).joinpath(CRD_RESOURCE)
        text, origin = ref.read_text(encoding="utf-8"), f"{CRD_PACKAGE}:{CRD_RESOURCE}"
    crd = yaml.safe_load(text)
    if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
        raise RuntimeError(f"{origin}: not a CustomResourceDefinition")
    log.debug("loaded crd origin=%s", origin)
    return crd


@functools.lru_cache(maxsize=8)
def _cached_schema(override: str | None) -> dict[str, Any]:
    for version in _cached_crd(override)["spec"]["versions"]:
        if version.get("name") == contract.API_VERSION:
            schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
            unsupported = sorted(set(_unsupported_keywords(schema, "")))
            if unsupported:
                raise RuntimeError("CRD uses schema keywords the validator does not "
                                   f"support: {', '.join(unsupported)}")
            return schema
    raise RuntimeError(f"CRD has no version {contract.API_VERSION}")


def _unsupported_keywords(schema: Mapping[str, Any], path: str) -> Iterator[str]:
    for key in schema:
        if key not in SUPPORTED_KEYWORDS:
            yield f"{path or '(root)'}: {key}"
    for name, sub in schema.get("properties", {}).items():
        yield from _unsupported_keywords(sub, join(path, name))
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), Mapping):
            yield from _unsupported_keywords(schema[key], f"{path}[*]")
    for branch in schema.get("anyOf", []):
        yield from _unsupported_keywords(branch, path)


# ------------------------------------------------------------------ public checks


def validate_job(doc: Mapping[str, Any], *, pruned: list[str] | None = None) -> dict[str, Any]:
    """A deep copy of ``doc`` with the CRD's defaults applied; SpecError lists every problem.
    With a `pruned` list (a job the API server stored, under a CRD newer than this code),
    fields this code does not know are dropped and named in it instead of refused."""
    if not isinstance(doc, Mapping):
        raise errors.SpecError(f"manifest: must be a mapping (got {kind(doc)})")
    problems = Problems()
    job: dict[str, Any] = copy.deepcopy(dict(doc))
    walker = Walker(problems, prune=pruned is not None)
    job = walker.walk(job, _schema(), "")
    if pruned is not None:
        pruned += walker.pruned
    _check_identity(job, problems)
    _check_metadata(job.get("metadata"), problems)
    _check_model(doc, problems)
    _check_partitions(job, problems)
    _check_micro_batches(job, problems)
    _check_data(job, problems)
    _check_training(job, problems)
    _check_autoscaling(job, problems)
    check_servers(job, problems)
    _check_overlap(job, problems)
    check_templates(job, problems)
    if problems.lines:
        raise errors.SpecError(problems.lines)
    return job


def job_config(
    validated: Mapping[str, Any], namespace_default: str = "default"
) -> contract.JobConfig:
    """The resolved config the pods read, from the output of :func:`validate_job` (with the
    job's uid when the API server stored it)."""
    metadata = validated["metadata"]
    return contract.JobConfig(
        name=metadata["name"],
        namespace=metadata.get("namespace") or namespace_default,
        written=copy.deepcopy(validated["spec"]),
        uid=metadata.get("uid") or None,
    )


# ---------------------------------------------------- rules the schema cannot say


def _check_identity(job: Mapping[str, Any], problems: Problems) -> None:
    for field, wanted in (("apiVersion", contract.JOB_API_VERSION), ("kind", contract.KIND)):
        if field not in job:
            problems.add(field, f"required, must be {wanted}")
        elif not problems.at(field) and job[field] != wanted:
            problems.add(field, f"must be {wanted} ({got(job[field])})")


def _check_metadata(metadata: Any, problems: Problems) -> None:
    if metadata is None:
        problems.add("metadata", "required")
        return
    if not isinstance(metadata, Mapping) or problems.at("metadata"):
        return
    name = metadata.get("name")
    if name is None:
        problems.add("metadata.name", "required")
    elif not isinstance(name, str):
        problems.add("metadata.name", f"must be of type string ({got(name)})")
    else:
        _check_job_name(name, problems)
    namespace = metadata.get("namespace")
    if namespace is not None and not (
        isinstance(namespace, str) and len(namespace) <= contract.DNS_LABEL_MAX
        and _DNS1123_LABEL.match(namespace)
    ):
        problems.add("metadata.namespace", "must be a DNS-1123 label: at most "
                     f"{contract.DNS_LABEL_MAX} lowercase alphanumerics or '-', starting "
                     f"and ending alphanumeric ({got(namespace)})")


def _check_job_name(name: str, problems: Problems) -> None:
    if not _DNS1035_LABEL.match(name):
        problems.add("metadata.name", "must be a DNS-1035 label: lowercase letters, digits or "
                     f"'-', starting with a letter and ending alphanumeric (got {show(name)})")
    if len(name) > contract.MAX_JOB_NAME:
        problems.add("metadata.name", f"must be at most {contract.MAX_JOB_NAME} characters "
                     f"(got {len(name)}) so that derived names such as "
                     f"<name>{contract.PS_SUFFIX}-<i> and the StatefulSet's revision label fit "
                     f"in {contract.DNS_LABEL_MAX}")


def _check_model(raw: Mapping[str, Any], problems: Problems) -> None:
    model = at_path(raw, "spec", "model")
    if isinstance(model, Mapping) and model.get("entrypoint") is not None \
            and model.get("type") is not None:
        problems.add("spec.model.entrypoint", "not allowed together with spec.model.type "
                     "(a model is either built in or user code)")
    if isinstance(model, Mapping) and model.get("entrypoint") is not None \
            and model.get("embeddings") is not None:
        problems.add("spec.model.embeddings", "not available with spec.model.entrypoint (user models "
                     "see one flat parameter vector)")
    if at_path(raw, "spec", "model", "embeddings") is not None \
            and at_path(raw, "spec", "training", "algorithm") == "sandblaster":
        problems.add("spec.model.embeddings", "needs spec.training.algorithm: downpour (Sandblaster's "
                     "L-BFGS runs over the dense parameters only)")


def _check_partitions(job: Mapping[str, Any], problems: Problems) -> None:
    """A partitioned replica cuts a built-in mlp's layers into consecutive stages, trains
    with Downpour, and places each stage's parameters on shards of its own."""
    path = "spec.model.partitions"
    partitions = at_path(job, "spec", "model", "partitions")
    if not isinstance(partitions, int) or partitions <= 1 or problems.at("spec.model"):
        return
    model = at_path(job, "spec", "model")
    if at_path(job, "spec", "training", "algorithm") == "sandblaster":
        problems.add(path, f"partitions > 1 is not supported with sandblaster (got {partitions}); "
                     "use spec.training.algorithm: downpour")
    if model.get("entrypoint") is not None:
        problems.add(path, "partitions > 1 needs a built-in mlp: a user model (spec.model.entrypoint) "
                     "cannot be cut into stages")
    elif model.get("type", "mlp") != "mlp":
        problems.add(path, f"partitions > 1 needs spec.model.type mlp (got {show(model['type'])}, "
                     "a single layer)")
    elif isinstance(model.get("hiddenLayers"), list) and len(model["hiddenLayers"]) + 1 < partitions:
        problems.add(path, f"{partitions} partitions need at least {partitions} layers, and the mlp has "
                     f"{len(model['hiddenLayers']) + 1} (spec.model.hiddenLayers plus the output layer)")
    if model.get("embeddings") is not None:
        problems.add(path, "partitions > 1 is not available with spec.model.embeddings")
    shards = at_path(job, "spec", "parameterServers", "shards")
    if isinstance(shards, int) and shards < partitions:
        problems.add(path, f"{partitions} partitions need at least {partitions} parameter shards, each "
                     f"partition its own (spec.parameterServers.shards is {shards})")


def _check_micro_batches(job: Mapping[str, Any], problems: Problems) -> None:
    """Micro-batches are the parts of a step's minibatch that go through a partitioned
    replica's stages one after another."""
    path = "spec.model.microBatches"
    micro = at_path(job, "spec", "model", "microBatches")
    if not isinstance(micro, int) or micro <= 1 or problems.at(path):
        return
    if (at_path(job, "spec", "model", "partitions") or 1) <= 1:
        problems.add(path, "micro-batches above 1 need spec.model.partitions > 1 (they go through a partitioned "
                     "replica's stages one after another)")
    batch = at_path(job, "spec", "training", "batchSize")
    if isinstance(batch, int) and micro > batch:
        problems.add(path, f"{micro} micro-batches need a minibatch of at least {micro} rows "
                     f"(spec.training.batchSize is {batch})")


def _check_data(job: Mapping[str, Any], problems: Problems) -> None:
    path = "spec.data.source"
    source = at_path(job, "spec", "data", "source")
    if not isinstance(source, str) or problems.at(path):
        return
    scheme, _, body = source.partition(":")
    if scheme == "builtin" and body not in contract.BUILTIN_DATASETS:
        problems.add(path, f"unknown builtin data set {show(body)} "
                     f"(known: {', '.join(contract.BUILTIN_DATASETS)})")
    elif scheme == "synthetic":
        for problem in contract.synthetic_params(body)[1]:
            problems.add(path, problem)
    elif scheme == "synthetic-ctr":
        for problem in contract.ctr_params(body)[1]:
            problems.add(path, problem)
        if at_path(job, "spec", "model", "embeddings") is None:
            problems.add(path, "synthetic-ctr data holds only ids: set spec.model.embeddings to embed them")
    elif scheme in FILE_SCHEMES and not posixpath.isabs(body):
        problems.add(path, f"a file source's path must be absolute inside the pod (got {show(body)})")
    elif scheme in FILE_SCHEMES and at_path(job, "spec", "data", "volume") and not body.startswith(DATA_DIR + "/"):
        problems.add(path, f"with spec.data.volume the files must be under {DATA_DIR}/, where the claim is "
                     f"mounted (got {show(body)})")
    _check_columns(job, scheme, body, problems)


def _check_columns(job: Mapping[str, Any], scheme: str, body: str, problems: Problems) -> None:
    """test, label, features and ids are a file source's (parquet:, csv:, npy:, an npz: glob)."""
    data = at_path(job, "spec", "data") or {}
    test = data.get("test")
    if data.get("objectStore") is not None and scheme != "s3":
        problems.add("spec.data.objectStore", "is for an s3:// source")
    if scheme == "s3" and isinstance(test, str) and not test.startswith("s3://"):
        problems.add("spec.data.test", "the held-out files of an s3:// source are s3:// too")
    many = scheme in ("npy", "parquet", "csv", "s3") or (scheme == "npz" and any(c in body for c in "*?["))
    if many:
        return
    if test is not None:
        problems.add("spec.data.test", "names held-out files of a file source (parquet:, csv:, npy:, s3:// or an npz: glob)")
    if data.get("features") is not None or data.get("ids") is not None or data.get("label", "y") != "y":
        problems.add("spec.data.label", "label, features and ids choose columns of a file source "
                     "(parquet:, csv:, npy:, s3:// or an npz: glob)")


def _check_training(job: Mapping[str, Any], problems: Problems) -> None:
    path = "spec.training.maxDuration"
    text = at_path(job, "spec", "training", "maxDuration")
    if not isinstance(text, str) or problems.at(path):
        return
    try:
        seconds = jobbase.parse_duration(text)
    except ValueError as exc:
        problems.add(path, str(exc))
        return
    if seconds <= 0:
        problems.add(path, f"must be > 0 (got {show(text)})")


def _check_autoscaling(job: Mapping[str, Any], problems: Problems) -> None:
    path = "spec.workers.autoscaling"
    autoscaling = at_path(job, "spec", "workers", "autoscaling")
    if not isinstance(autoscaling, Mapping) or problems.at(path):
        return
    low, high = autoscaling.get("minReplicas"), autoscaling.get("maxReplicas")
    if isinstance(low, int) and isinstance(high, int) and low > high:
        problems.add(f"{path}.minReplicas", f"must be <= maxReplicas (got {low} > {high})")


def _check_overlap(job: Mapping[str, Any], problems: Problems) -> None:
    """The overlapped loop is the dense Downpour replica's, one push and one pull a step."""
    path = "spec.training.overlap"
    training = at_path(job, "spec", "training")
    if not isinstance(training, Mapping) or training.get("overlap") is not True or problems.at(path):
        return
    if training.get("fetchEvery", 1) != 1 or training.get("pushEvery", 1) != 1:
        problems.add(path, "needs spec.training.fetchEvery and pushEvery 1 (each step's exchange is one push and "
                     "the pull after it)")
    if training.get("algorithm") == "sandblaster":
        problems.add(path, "not available with spec.training.algorithm: sandblaster; use downpour")
    if at_path(job, "spec", "model", "embeddings") is not None:
        problems.add(path, "not available with spec.model.embeddings")
    if (at_path(job, "spec", "model", "partitions") or 1) > 1:
        problems.add(path, "not available with spec.model.partitions > 1")
    if training.get("maxStaleness") == 0:
        problems.add(path, "needs spec.training.maxStaleness of at least 1 (an overlapped gradient is always one "
                     "update behind its own replica's last)")
