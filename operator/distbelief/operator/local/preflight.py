"""Local mode's checks before any pod starts: the job's data and model, loaded once.

Every role would find the same problem and exit with a config error; finding it here
says it in one line, before the output folder or a process is touched. The data
checks (shapes, non-finite values, labels) live in the runtime's loader and the model
interface checks in its model builder, so a pod on a cluster refuses the same things.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Checked:
    """What a job's data and model turned out to be."""

    examples: int
    features: int
    classes: int
    parameters: int
    shapes: list[tuple[str, tuple[int, ...]]]
    layout: int   # the hash of the parameters' layout over the shards, as every role derives it


def check(job: Mapping[str, Any]) -> Checked:
    """Load the job's data and build its model as every role will; raises ConfigError."""
    from distbelief.operator.spec.spec import job_config
    from distbelief.runtime.model import data, models
    from distbelief.runtime.roles import common

    spec = job["spec"]
    dataset = data.load(spec["data"])
    model = models.build_model(spec["model"], dataset.n_features, dataset.n_classes)
    checked = Checked(examples=len(dataset.x_train) + len(dataset.x_test), features=dataset.n_features,
                      classes=dataset.n_classes, parameters=models.num_params(model),
                      shapes=[(name, tuple(shape)) for name, shape in model.shapes],
                      layout=common.model_layout(model, job_config(job))[1].hash)
    log.info("event=preflight_passed job=%s examples=%d features=%d classes=%d parameters=%d",
             job["metadata"]["name"], checked.examples, checked.features, checked.classes, checked.parameters)
    return checked
