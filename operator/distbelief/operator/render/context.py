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

from distbelief.operator.spec.spec import job_config
from distbelief.runtime import contract

# Fields that only size the job. They stay in the ConfigMap but not in the config hash,
# so that scaling (by hand, or by the HPA through the scale subresource) and suspending
# never restart the running shards and replicas.
_SCALING_FIELDS: tuple[tuple[str, ...], ...] = (
    ("workers", "replicas"),
    ("workers", "autoscaling"),
    ("runPolicy",),
)


# The placement a queue's admission gave the job's pods (render/queue.py), by role.
ADMISSION_ANNOTATION = f"{contract.API_GROUP}/admission"


@dataclasses.dataclass(frozen=True)
class RenderContext:
    """What every render_* function needs to know about one job."""

    config: contract.JobConfig
    image: str
    uid: str | None
    config_json: str
    config_hash: str
    finished: bool = False
    operator_namespace: str | None = None   # None: the job's own
    placement: Mapping[str, Any] | None = None  # role -> {nodeSelector, tolerations} of an admission

    @classmethod
    def of(cls, job: Mapping[str, Any], *, image: str, finished: bool = False,
           operator_namespace: str | None = None) -> RenderContext:
        config = job_config(job)
        return cls(
            config=config,
            image=config.spec.image or image,
            uid=job["metadata"].get("uid"),
            config_json=config.to_json(),
            config_hash=config_hash(config),
            finished=finished,
            operator_namespace=operator_namespace,
            placement=admitted_placement(job),
        )

    @property
    def names(self) -> contract.JobNames:
        return self.config.names

    @property
    def spec(self) -> Mapping[str, Any]:
        return self.config.written

    @property
    def suspended(self) -> bool:
        return bool(self.spec.get("runPolicy", {}).get("suspend"))

    @property
    def shard_replicas(self) -> int:
        """0 while suspended, and once finished unless cleanPodPolicy keeps the shards."""
        keep_shards = self.spec.get("runPolicy", {}).get("cleanPodPolicy") == "None"
        stopped = self.suspended or (self.finished and not keep_shards)
        servers = self.config.spec.parameter_servers
        return 0 if stopped else servers.shards * servers.copies

    @property
    def worker_replicas(self) -> int:
        return 0 if self.suspended or self.finished else int(self.spec["workers"]["replicas"])


def admitted_placement(job: Mapping[str, Any]) -> dict[str, Any] | None:
    """The role -> {nodeSelector, tolerations} the job runs with, None when not admitted."""
    text = ((job.get("metadata") or {}).get("annotations") or {}).get(ADMISSION_ANNOTATION)
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
