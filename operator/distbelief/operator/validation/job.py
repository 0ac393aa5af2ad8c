"""A DistBeliefJob as the operator and its commands act on it, parsed once where its dict
comes in (a kopf handler's body, a manifest file, the API, a local run's status.json).

Its values are read through `config` alone: the name, namespace and uid, and `config.spec`,
the typed spec (jobspec.JobSpec); `config.written` is the spec's dict only to be written
back out (the ConfigMap, status.json). Beside it, the rest of the object the operator
keys on: generation, labels, annotations, creation time, and the status as the operator
last wrote it (a mapping: compute_status makes it).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from distbelief.operator.validation.spec import job_config, validate_job
from distbelief.runtime import contract


@dataclasses.dataclass(frozen=True)
class DistBeliefJob:
    config: contract.JobConfig
    generation: int = 0
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    created: str | None = None      # metadata.creationTimestamp, as the API server writes it
    status: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, job: Mapping[str, Any], namespace_default: str = "default") -> DistBeliefJob:
        """The job of an object as stored: validated (spec.validate_job, whose defaults the
        typed spec needs no more than the API server's), or as the API server holds it.
        ValueError names a field of the spec of the wrong type."""
        meta = job["metadata"]
        return cls(config=job_config(job, namespace_default), generation=int(meta.get("generation") or 0),
                   labels=dict(meta.get("labels") or {}), annotations=dict(meta.get("annotations") or {}),
                   created=meta.get("creationTimestamp"), status=copy.deepcopy(dict(job.get("status") or {})))

    @classmethod
    def validated(cls, doc: Mapping[str, Any]) -> DistBeliefJob:
        """The job of a manifest, checked with spec.validate_job first (SpecError lists every problem)."""
        return cls.of(validate_job(doc))

    def manifest(self) -> dict[str, Any]:
        """The object as the API server would hold it, status included."""
        metadata: dict[str, Any] = {"name": self.config.name, "namespace": self.config.namespace}
        for key, value in (("uid", self.config.uid), ("generation", self.generation), ("labels", self.labels),
                           ("annotations", self.annotations), ("creationTimestamp", self.created)):
            if value:
                metadata[key] = copy.deepcopy(value)
        return {"apiVersion": contract.JOB_API_VERSION, "kind": contract.KIND, "metadata": metadata,
                "spec": copy.deepcopy(dict(self.config.written)), "status": copy.deepcopy(dict(self.status))}
