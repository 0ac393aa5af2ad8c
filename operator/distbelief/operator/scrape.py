"""Reading a job's training figures from the chief's Prometheus endpoint.

Local mode's progress bar and the operator's status both come from here, so they agree.
"""

from __future__ import annotations

import dataclasses
import math
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class Figures:
    global_step: int | None = None
    loss: float | None = None
    accuracy: float | None = None
    auc: float | None = None                # two-class jobs only
    examples_per_second: float | None = None
    objective: float | None = None          # Sandblaster's, at the committed iteration
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None
    finished_reason: str | None = None
    finished_outcome: str | None = None

    @property
    def reachable(self) -> bool:
        return self.global_step is not None


def parse(text: str) -> Figures:
    values: dict[str, float] = {}
    finished: tuple[str, str] | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "distbelief_job_finished" and sample.value == 1:
                finished = (sample.labels.get("reason", ""), sample.labels.get("outcome", ""))
            else:
                values[sample.name] = sample.value

    def integer(name: str) -> int | None:
        return int(values[name]) if name in values else None

    return Figures(
        global_step=integer("distbelief_global_step"),
        loss=values.get("distbelief_heldout_loss"),
        accuracy=values.get("distbelief_heldout_accuracy"),
        auc=_finite(values.get("distbelief_heldout_auc")),
        examples_per_second=values.get("distbelief_examples_per_second"),
        # The gauge exists from the coordinator's start; it means something after an evaluation.
        objective=values.get("distbelief_sandblaster_objective") if values.get(
            "distbelief_sandblaster_evaluations_total") else None,
        checkpoint_step=integer("distbelief_checkpoint_step"),
        checkpoint_time=values.get("distbelief_checkpoint_timestamp_seconds") or None,
        finished_reason=finished[0] if finished else None,
        finished_outcome=finished[1] if finished else None,
    )


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def read(url: str, *, timeout: float = TIMEOUT_SECONDS) -> Figures:
    """The figures at url (a /metrics endpoint); empty Figures when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return parse(response.read().decode())
    except (OSError, urllib.error.URLError, ValueError):
        return Figures()
