"""Local mode's checks before any pod starts: the job's data and model, loaded once.

Every role would find the same problem and exit with a config error; finding it here
says it in one line, before the output folder or a process is touched. The data
checks (shapes, non-finite values, labels) live in the runtime's loader and the model
interface checks in its model builder, so a pod on a cluster refuses the same things.
"""

from __future__ import annotations

import dataclasses
import logging

from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime.wire.layout import Layout

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Checked:
    """What a job's data and model turned out to be."""

    examples: int
    features: int
    classes: int
    parameters: int
    shapes: list[tuple[str, tuple[int, ...]]]
    layout: Layout   # the parameters' layout over the shards, as every role derives it


def check(job: DistBeliefJob) -> Checked:
    """Derive the job's data, model and layout as every role will (model.job.Job, the one
    derivation); raises ConfigError."""
    from distbelief.runtime.model import models
    from distbelief.runtime.model.job import Job

    derived = Job(job.config)
    dataset, model = derived.dataset, derived.model   # streamed files: the held-out part, checked
    examples = (len(dataset.y_train) + len(dataset.y_test) if derived.files is None else
                sum(unit.rows for unit in derived.files.train_units + derived.files.test_units))  # Parquet's count
    checked = Checked(examples=examples, features=dataset.n_features,
                      classes=dataset.n_classes, parameters=models.num_params(model),
                      shapes=[(name, tuple(shape)) for name, shape in model.shapes], layout=derived.layout)
    log.info("event=preflight_passed job=%s examples=%d features=%d classes=%d parameters=%d",
             job.config.name, checked.examples, checked.features, checked.classes, checked.parameters)
    return checked
