"""What every render_* function knows of one job (RenderContext), and the config hash that
rolls its pods when the config changes.

Pure values: render.py and podparts.py both build on these.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract, jobspec

# Fields that only size the job. They stay in the ConfigMap but not in the config hash,
# so that scaling (by hand, or by the HPA through the scale subresource) and suspending
# never restart the running shards and replicas.
_SCALING_FIELDS: tuple[tuple[str, ...], ...] = (
    ("workers", "replicas"),
    ("workers", "autoscaling"),
    ("runPolicy",),
)


# The image the roles run when neither the job nor the operator's settings name one.
DEFAULT_IMAGE = "distbelief/distbelief:0.1.0"

# The placement a queue's admission gave the job's pods (render/queue.py), by role.
ADMISSION_ANNOTATION = f"{contract.API_GROUP}/admission"


@dataclasses.dataclass(frozen=True)
class RenderContext:
    """What every render_* function needs to know about one job: its config (whose spec,
    config.spec, is the typed job), and how it is to run."""

    config: contract.JobConfig
    image: str
    config_json: str
    config_hash: str
    finished: bool = False
    held: bool = False                      # a queue holds the job: rendered suspended (cluster/queue.py)
    operator_namespace: str | None = None   # None: the job's own
    placement: Mapping[str, Any] | None = None  # role -> {nodeSelector, tolerations} of an admission

    @classmethod
    def of(cls, job: DistBeliefJob, *, image: str, finished: bool = False, held: bool = False,
           operator_namespace: str | None = None) -> RenderContext:
        config = job.config
        return cls(
            config=config,
            image=config.spec.image or image,
            config_json=config.to_json(),
            config_hash=config_hash(config),
            finished=finished,
            held=held,
            operator_namespace=operator_namespace,
            placement=admitted_placement(job),
        )

    @property
    def names(self) -> contract.JobNames:
        return self.config.names

    @property
    def spec(self) -> jobspec.JobSpec:
        return self.config.spec

    @property
    def suspended(self) -> bool:
        return self.spec.run_policy.suspend or self.held

    @property
    def shard_replicas(self) -> int:
        """0 while suspended, and once finished unless cleanPodPolicy keeps the shards."""
        keep_shards = self.spec.run_policy.clean_pod_policy == "None"
        stopped = self.suspended or (self.finished and not keep_shards)
        servers = self.spec.parameter_servers
        return 0 if stopped else servers.shards * servers.copies

    @property
    def worker_replicas(self) -> int:
        return 0 if self.suspended or self.finished else self.spec.workers.replicas


def admitted_placement(job: DistBeliefJob) -> dict[str, Any] | None:
    """The role -> {nodeSelector, tolerations} the job runs with, None when not admitted."""
    text = job.annotations.get(ADMISSION_ANNOTATION)
    return json.loads(text) if text else None


def config_hash(config: contract.JobConfig) -> str:
    """First 16 hex digits of the sha256 of the config, without the scaling-only fields and
    the uid (which a job keeps for life, and which jobs made before it was in the config
    lacked: an upgrade must not restart their pods for it)."""
    spec = copy.deepcopy(dict(config.written))
    for path in _SCALING_FIELDS:
        parent = spec
        for key in path[:-1]:
            parent = parent.get(key, {})
        parent.pop(path[-1], None)
    text = dataclasses.replace(config, written=spec, uid=None).to_json()
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
