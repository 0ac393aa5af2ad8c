"""What a job's config comes to, derived in one place: its data, its model (with
embeddings when spec.model.embeddings is set), the model's cut into stages (when
spec.model.partitions > 1) and the parameters' layout over the shards.

Every role derives these from the config it reads, and local mode's checks before a
run (the layout hash an output folder's checkpoints must have) and `distbelief predict`
call the same `Job`, so they cannot disagree on what the model is.
"""

from __future__ import annotations

from distbelief.runtime import contract, errors, jobspec
from distbelief.runtime.model import data, embedding, models, stages
from distbelief.runtime.wire.layout import Layout


class Job:
    """A job's config (`config`), its typed spec (`spec`), and what follows from them:
    `dataset`, `model`, `plan` (None unless partitioned) and `layout`."""

    def __init__(self, config: contract.JobConfig) -> None:
        self.config = config
        self.spec: jobspec.JobSpec = config.resolved
        self.dataset = data.load(self.spec.data)
        self.model: models.Model = (
            embedding.build(self.spec.model, self.dataset) if self.spec.model.embeddings is not None
            else models.build_model(self.spec.model, self.dataset.n_features, self.dataset.n_classes))
        partitions = self.spec.model.partitions
        self.plan: stages.Plan | None = stages.plan(self.model, partitions) if partitions > 1 else None
        self.layout = Layout.of(self.model.shapes, config.shards, self.plan.boundaries if self.plan else ())

    def stage_shards(self, partition: int) -> list[int]:
        """The shards holding a partition's stage."""
        assert self.plan is not None, "an unpartitioned job has no stages"
        stage = self.plan.stages[partition]
        return self.layout.shards_of(stage.offset, stage.offset + stage.size)

    @classmethod
    def load(cls, path: str) -> "Job":
        """The job of the config file at path (the ConfigMap's); ConfigError if unreadable."""
        try:
            return cls(contract.JobConfig.load(path))
        except (OSError, ValueError, KeyError) as exc:
            raise errors.ConfigError(f"cannot read job config {path}: {exc}") from exc
