"""Reading a job's training figures from the chief's Prometheus endpoint.

Local mode's progress bar and the operator's status both come from here, so they agree.
"""

from __future__ import annotations

import dataclasses
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class Figures:
    global_step: int | None = None
    loss: float | None = None
    train_loss: float | None = None         # shard 0's moving average of the replicas' minibatch losses
    accuracy: float | None = None
    examples_per_second: float | None = None
    objective: float | None = None          # Sandblaster's, at the committed iteration
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None
    finished_reason: str | None = None
    finished_outcome: str | None = None
    replica_loss: float | None = None       # a replica's: the loss of its last minibatch
    replica_steps: int | None = None        # a replica's: the minibatches it computed
    replica_examples: int | None = None     # a replica's: the examples it trained on
    staleness_max: int | None = None        # the largest staleness of an update shard 0 applied
    staleness_p50: float | None = None      # the median's bucket bound, from shard 0's histogram

    @property
    def reachable(self) -> bool:
        return self.global_step is not None


def parse(text: str) -> Figures:
    values: dict[str, float] = {}
    finished: tuple[str, str] | None = None
    staleness: list[tuple[float, float]] = []  # (bucket bound, updates at most that stale)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "distbelief_job_finished" and sample.value == 1:
                finished = (sample.labels.get("reason", ""), sample.labels.get("outcome", ""))
            elif sample.name == "distbelief_staleness_updates_bucket":
                staleness.append((float(sample.labels["le"]), sample.value))
            else:
                values[sample.name] = sample.value

    def integer(name: str) -> int | None:
        return int(values[name]) if name in values else None

    return Figures(
        global_step=integer("distbelief_global_step"),
        loss=values.get("distbelief_heldout_loss"),
        train_loss=values.get("distbelief_train_loss"),
        accuracy=values.get("distbelief_heldout_accuracy"),
        examples_per_second=values.get("distbelief_examples_per_second"),
        # The gauge exists from the coordinator's start; it means something after an evaluation.
        objective=values.get("distbelief_sandblaster_objective") if values.get(
            "distbelief_sandblaster_evaluations_total") else None,
        checkpoint_step=integer("distbelief_checkpoint_step"),
        staleness_max=integer("distbelief_staleness_max"),
        staleness_p50=_median_bound(staleness),
        checkpoint_time=values.get("distbelief_checkpoint_timestamp_seconds") or None,
        finished_reason=finished[0] if finished else None,
        finished_outcome=finished[1] if finished else None,
        replica_loss=values.get("distbelief_worker_loss"),
        replica_steps=integer("distbelief_worker_steps_total"),
        replica_examples=integer("distbelief_worker_examples_total"),
    )


def _median_bound(buckets: list[tuple[float, float]]) -> float | None:
    """The upper bound of the histogram bucket that holds the median; None before any update."""
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    return next(bound for bound, count in buckets if count >= total / 2)


def read(url: str, *, timeout: float = TIMEOUT_SECONDS) -> Figures:
    """The figures at url (a /metrics endpoint); empty Figures when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return parse(response.read().decode())
    except (OSError, urllib.error.URLError, ValueError):
        return Figures()
