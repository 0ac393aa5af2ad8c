"""The chief's held-out record and its verdict on a model that degraded.

The chief keeps a HeldOutRecord of its evaluations (the best, by AUC for two classes and
accuracy otherwise; the last; the first held-out loss that diverged) and judges it when
the job ends (degradation): a model whose held-out metric ended at chance, far below its
own best, or whose held-out loss diverged is degraded. The verdict goes to result.json and
the metric distbelief_model_degraded, from which the operator's status makes the
condition ModelDegraded (status.py), in local mode and on a cluster alike.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Mapping

import numpy as np

log = logging.getLogger(__name__)

CHANCE_MARGIN = 0.02   # a held-out metric within this of chance is at chance
FALL_FROM_BEST = 0.05  # ... this far below the job's own best has fallen from it
LOSS_JUMP = 10.0       # a held-out loss this many times its lowest so far has diverged


class HeldOutRecord:
    """What the chief remembers of the held-out evaluations: the best (by AUC for two
    classes, else accuracy), the last, and the first diverged loss."""

    def __init__(self, *, two_classes: bool, chance: float) -> None:
        self.metric, self.chance = ("auc" if two_classes else "accuracy"), chance
        self.best: float | None = None
        self.best_step = 0
        self.last: float | None = None
        self.last_step = 0
        self.last_loss: float | None = None
        self.lowest_loss: float | None = None
        self.diverged: dict[str, Any] | None = None

    def observe(self, step: int, loss: float, accuracy: float, auc: float | None) -> bool:
        """Take one evaluation; True if it is the best so far."""
        value = auc if self.metric == "auc" and auc is not None else accuracy
        finite = math.isfinite(loss)
        if self.diverged is None and self.lowest_loss is not None and (
                not finite or loss >= LOSS_JUMP * self.lowest_loss):
            self.diverged = {"step": step, "from": self.lowest_loss, "to": loss if finite else None}
            log.warning("event=heldout_loss_diverged step=%d from=%.4g to=%s", step, self.lowest_loss, loss)
        if finite and (self.lowest_loss is None or loss < self.lowest_loss):
            self.lowest_loss = loss
        self.last, self.last_step, self.last_loss = value, step, loss if finite else None
        if self.best is None or value > self.best:
            self.best, self.best_step = value, step
            return True
        return False

    def replay(self, path: str) -> None:
        """Take the evaluations of an earlier run of the job (its history.jsonl), so that a
        restarted chief judges the job's whole record."""
        try:
            with open(path, encoding="utf-8") as f:
                lines = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return
        for line in lines:
            try:
                self.observe(int(line["step"]), float(line["loss"]), float(line["accuracy"]), line.get("auc"))
            except (KeyError, TypeError, ValueError):
                continue

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "chance": self.chance, "best": self.best, "bestStep": self.best_step,
                "last": self.last, "lastStep": self.last_step, "lastLoss": self.last_loss,
                "lowestLoss": self.lowest_loss, "diverged": self.diverged}


def chance_level(y_test: np.ndarray, two_classes: bool) -> float:
    """What a model without skill scores: AUC 0.5, or the accuracy of the majority class."""
    if two_classes or not y_test.size:
        return 0.5 if two_classes else 0.0
    return float(np.bincount(y_test).max() / y_test.size)


def degradation(record: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) when a held-out record (HeldOutRecord.as_dict) shows a degraded
    model, else None: its loss diverged (non-finite, or LOSS_JUMP times its lowest) and is
    still so at the end, its metric ended at chance, or fell FALL_FROM_BEST below its best."""
    best, last, last_loss = record.get("best"), record.get("last"), record.get("lastLoss")
    if last is None or best is None:
        return None
    name = "AUC" if record["metric"] == "auc" else str(record["metric"])
    chance, diverged = float(record["chance"]), record.get("diverged")
    jump = f"held-out loss went from {diverged['from']:.4g} to {_loss(diverged['to'])} at step " \
        f"{diverged['step']}" if diverged else ""
    if diverged and (last_loss is None or last_loss >= LOSS_JUMP * float(diverged["from"])):
        return "HeldOutLossDiverged", f"{jump}; at step {record['lastStep']} it is {_loss(last_loss)} " \
            f"(held-out {name} {last:.4f}, best {best:.4f} at step {record['bestStep']})"
    tail = f"; {jump}" if jump else ""
    if last <= chance + CHANCE_MARGIN:
        return "HeldOutAtChance", f"held-out {name} ended at {last:.4f}, chance level ({chance:.4f}); its best " \
            f"was {best:.4f} at step {record['bestStep']}{tail}"
    if best - last >= FALL_FROM_BEST:
        return "HeldOutFellFromBest", f"held-out {name} ended at {last:.4f} (step {record['lastStep']}), " \
            f"{best - last:.4f} below its best {best:.4f} at step {record['bestStep']}{tail}"
    return None


def _loss(loss: float | None) -> str:
    return "a non-finite value" if loss is None or not math.isfinite(loss) else f"{loss:.4g}"

