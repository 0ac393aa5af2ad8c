"""What a job's config comes to, derived in one place: its data, its model (with
embeddings when spec.model.embeddings is set), the model's cut into stages (when
spec.model.partitions > 1) and the parameters' layout over the shards.

Every role derives these from the config it reads, and local mode's checks before a
run (the layout hash an output folder's checkpoints must have) and `distbelief predict`
call the same `Job`, so they cannot disagree on what the model is.
"""

from __future__ import annotations

import functools

from distbelief.runtime import contract, errors, jobspec
from distbelief.runtime.model import data, embedding, files, models, stages
from distbelief.runtime.wire.layout import Layout


class Job:
    """A job's config (`config`, whose typed spec is `spec`), and what follows from it:
    `dataset`, `model`, `plan` (None unless partitioned) and `layout`."""

    def __init__(self, config: contract.JobConfig) -> None:
        self.config = config
        self.files: files.FileSet | None = files.FileSet(self.spec.data) if self.spec.streams_data else None
        shape = self.files or self.dataset
        self.model: models.Model = (
            embedding.build(self.spec.model, shape) if self.spec.model.embeddings is not None
            else models.build_model(self.spec.model, shape.n_features, shape.n_classes))
        partitions = self.spec.model.partitions
        self.plan: stages.Plan | None = stages.plan(self.model, partitions) if partitions > 1 else None
        self.layout = Layout.of(self.model.shapes, self.spec.parameter_servers.shards,
                                self.plan.boundaries if self.plan else ())

    @property
    def spec(self) -> jobspec.JobSpec:
        return self.config.spec

    @functools.cached_property
    def dataset(self) -> data.Dataset:
        """The data set, loaded when first used. When the replicas stream the files, it holds
        the held-out part only, at most maxEvalExamples of it (the chief's): no pod holds the
        training files."""
        if self.files is None:
            return data.load(self.spec.data)
        return data.held_out_only(self.files, self.spec.data.max_eval_examples)

    def data_bytes(self, shard: int) -> int:
        """The memory a shard's process holds of the data: the data set; when the replicas
        stream the files, shard 0's chief's held-out part only, and none on any other shard."""
        if self.files is not None and shard != 0:
            return 0
        return self.dataset.nbytes

    @property
    def n_classes(self) -> int:
        """The classes, without loading the data set when the replicas stream it."""
        return self.files.n_classes if self.files is not None else self.dataset.n_classes

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
