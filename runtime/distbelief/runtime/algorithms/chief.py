"""The chief: the one place that evaluates the model and decides that the job is done.

It runs beside shard 0 (same process, its own thread and sockets) and talks to every
shard through the same protocol as a replica, so it depends on no replica surviving.
Every evalEverySeconds, or as soon as shard 0 reaches maxSteps, it pulls the current
parameters, scores them on the held-out set, appends the figures to history.jsonl, and
checks the stopping rules. When one holds it sends DONE to every shard (each writes a
final checkpoint and tells its replicas to stop) and writes result.json.

It keeps the held-out record (quality.py: the best evaluation, and where the held-out loss
diverged) and judges it when the job ends: a model that ended at chance, far below its own
best, or with a diverged loss is degraded, which result.json and the metric
distbelief_model_degraded say (the job's condition ModelDegraded), and with
spec.training.failOnDegraded the job fails. With spec.training.keepBest the parameters of
each new best evaluation are saved as params-best.npz. With embeddings it also reads every
shard's row figures (its rows, budget, refused and evicted rows) at each evaluation.

How the parameters are pulled and scored is a Scorer's: WholeModel pulls every shard's
slice into one vector (a partitioned model's scorer holds one stage at a time instead,
pipeline/evaluation.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Protocol

import numpy as np

from distbelief.runtime import contract, errors, jobspec
from distbelief.runtime.algorithms.quality import HeldOutRecord, degradation
from distbelief.runtime.client.group import ShardGroup
from distbelief.runtime.model import models
from distbelief.runtime.model.data import Dataset
from distbelief.runtime.observe.metrics import ChiefMetrics
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.shard.losses import KEY as LOST_KEY

log = logging.getLogger(__name__)

SUCCEEDED, FAILED, UPDATES_LOST = contract.SUCCEEDED, contract.FAILED, contract.UPDATES_LOST
# What a history line says of the replicas when the algorithm's shards report nothing of
# them (Sandblaster's; Downpour's shard 0 reports these: algorithms/downpour/updates.py).
REPLICA_FIGURES = {"trainLoss": None, "replicas": 0, "examplesPerSecondPerReplica": None}


@dataclasses.dataclass(frozen=True)
class StoppingRules:
    max_steps: int
    target_accuracy: float | None = None
    target_loss: float | None = None
    max_duration: float | None = None

    @classmethod
    def of(cls, training: jobspec.Training) -> "StoppingRules":
        return cls(max_steps=training.max_steps, target_accuracy=training.target_accuracy,
                   target_loss=training.target_loss, max_duration=training.max_duration_seconds)

    def verdict(self, *, step: int, loss: float, accuracy: float, elapsed: float,
                converged: bool = False) -> tuple[str, str] | None:
        """(reason, outcome) if the job is done, else None."""
        if self.target_accuracy is not None and accuracy >= self.target_accuracy:
            return "TargetAccuracyReached", SUCCEEDED
        if self.target_loss is not None and loss <= self.target_loss:
            return "TargetLossReached", SUCCEEDED
        if converged:
            return "Converged", SUCCEEDED
        if step >= self.max_steps:
            return "MaxStepsReached", SUCCEEDED
        if self.max_duration is not None and elapsed >= self.max_duration:
            return "DeadlineExceeded", FAILED
        return None


@dataclasses.dataclass(frozen=True)
class Score:
    step: int
    loss: float
    accuracy: float
    auc: float | None = None   # two-class jobs


class Scorer(Protocol):
    def score(self) -> Score | None:
        """Pull the parameters and score them; None if a shard says the job is done."""
        ...

    def save(self, path: str) -> None:
        """Write the parameters (one array per named tensor) to an .npz file."""
        ...

    def close(self) -> None: ...


# The model the chief scores and its held-out inputs, when they are not the model and the data's x.
HeldOut = Callable[[], tuple[models.Model, np.ndarray]]


class WholeModel:
    """Scores the whole flat vector, pulled from every shard at once."""

    def __init__(self, group: ShardGroup, model: models.Model, dataset: Dataset, max_eval_examples: int,
                 held_out: HeldOut | None = None) -> None:
        """held_out: the model to score and its held-out inputs, when they are not the data's x
        (a model with embeddings scores its MLP on inputs built from the shards' rows)."""
        self.group, self.model = group, model
        x_test = dataset.x_test[:max_eval_examples]
        self.y_test = dataset.y_test[:max_eval_examples]
        self.held_out = held_out or (lambda: (model, x_test))
        self.two_classes = dataset.n_classes == 2
        self.params = np.empty(group.layout.total, dtype=np.float32)
        self.dense = Float32Dense(group)

    def score(self) -> Score | None:
        replies = self.dense.pull(self.params)
        if any(r.done for r in replies):
            return None
        model, x = self.held_out()
        loss, accuracy = models.evaluate(model, self.params, x, self.y_test)
        auc = models.held_out_auc(model, self.params, x, self.y_test) if self.two_classes else None
        return Score(replies[0].header.step, loss, accuracy, auc)

    def save(self, path: str) -> None:
        """The parameters just scored: they are the trained model's."""
        models.save_params(path, models.split_params(self.model, self.params).items())

    def close(self) -> None:
        self.group.close()


class Chief:
    def __init__(self, *, group: ShardGroup, scorer: Scorer, rules: StoppingRules, eval_every: float,
                 output_dir: str, start_time: float, metrics: ChiefMetrics, training: Callable[[], dict[str, Any]],
                 optimizer_state: Callable[[], dict | None] = lambda: None, copies: bool = False,
                 record: HeldOutRecord | None = None, keep_best: bool = False, fail_on_degraded: bool = False,
                 fail_on_updates_lost: bool = False, rows: bool = False) -> None:
        """copies: the shards have backups, whose state each evaluation also reports; record:
        the held-out record to keep (two classes, chance 0.5 when not given); keep_best,
        fail_on_degraded and fail_on_updates_lost: spec.training's; rows: the shards hold
        embedding rows, whose figures each evaluation also reads. Every evaluation reads
        the updates each shard lost (shard/losses.py)."""
        self.group, self.scorer, self.rules = group, scorer, rules
        self.copies, self.rows = copies, rows
        self.record = record or HeldOutRecord(two_classes=True, chance=0.5)
        self.keep_best, self.fail_on_degraded = keep_best, fail_on_degraded
        self.fail_on_updates_lost = fail_on_updates_lost
        self.updates_lost: dict[int, int] = {}   # shard -> applied updates it lost, as last reported
        self.eval_every, self.output_dir, self.start_time = eval_every, output_dir, start_time
        self.metrics = metrics
        self.training = training  # shard 0's training figures (examples, examples/s, train loss, replicas)
        self.optimizer_state = optimizer_state  # Sandblaster's committed state on shard 0, if any
        self.failure: BaseException | None = None
        self.on_failure: Callable[[], None] = lambda: None
        self.more_figures: Callable[[], dict[str, Any]] = lambda: {}  # for history and result (the data's epoch)
        self._wake = threading.Event()
        self._stop = group.stop  # also ends a round that waits for a silent shard
        self._thread = threading.Thread(target=self._run, name="chief", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def step_reached(self, step: int) -> None:
        """Called by shard 0 after each update: wake early when maxSteps is reached."""
        if step == self.rules.max_steps or self._converged():
            self._wake.set()

    def _converged(self) -> bool:
        return bool((self.optimizer_state() or {}).get("converged"))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.evaluate_and_decide():
                    return
                self._wake.wait(self.eval_every)
                self._wake.clear()
        except errors.Stopped:
            pass
        except Exception as exc:  # a chief that dies must take its shard down: no job may hang
            log.exception("event=chief_failed error=%r", str(exc))
            self.failure = exc
            self.on_failure()
        finally:
            self.scorer.close()
            self.group.close()

    def evaluate_and_decide(self) -> bool:
        """One evaluation; True once the job is done."""
        score = self.scorer.score()
        if score is None:
            return True  # finished before this chief started (a restarted shard 0)
        step, loss, accuracy, auc = score.step, score.loss, score.accuracy, score.auc
        elapsed = time.time() - self.start_time
        self._record(step=step, loss=loss, accuracy=accuracy, elapsed=elapsed, auc=auc)
        if self.record.observe(step, loss, accuracy, auc) and self.keep_best:
            self.scorer.save(os.path.join(self.output_dir, contract.BEST_PARAMS_FILE))
        stats = self.group.stats()
        self._record_losses(stats)
        if self.copies:
            self._record_copies(stats)
        if self.rows:
            self._record_rows(stats)
        verdict = self.rules.verdict(step=step, loss=loss, accuracy=accuracy, elapsed=elapsed,
                                     converged=self._converged())
        if verdict is None:
            return False
        self._finish(*verdict, step=step, loss=loss, accuracy=accuracy, elapsed=elapsed, auc=auc)
        return True

    def _record(self, *, step: int, loss: float, accuracy: float, elapsed: float, auc: float | None) -> None:
        self.metrics.loss.set(loss)
        self.metrics.accuracy.set(accuracy)
        self.metrics.evaluated_step.set(step)
        line = {"time": time.time(), "elapsed": round(elapsed, 3), "step": step, "loss": loss,
                "accuracy": accuracy, **self.training(), **self.more_figures()}
        for key, value in REPLICA_FIGURES.items():
            line.setdefault(key, value)
        if auc is not None:
            line["auc"] = auc
            self.metrics.auc.set(auc)
        with open(os.path.join(self.output_dir, contract.HISTORY_FILE), "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        log.info("event=evaluated step=%d loss=%.4f accuracy=%.4f", step, loss, accuracy)

    def _record_losses(self, every: list[dict]) -> None:
        """The applied updates each shard lost (a restore or takeover behind what it served)."""
        for shard, stats in enumerate(every):
            lost = int(stats.get(LOST_KEY, 0))
            if lost > self.updates_lost.get(shard, 0):
                log.warning("event=updates_lost shard=%d lost=%d", shard, lost)
            self.updates_lost[shard] = lost
            self.metrics.updates_lost.labels(shard=str(shard)).set(lost)

    def _record_copies(self, every: list[dict]) -> None:
        """Each shard's copies in sync, its primary's rank and its failovers, as its primary says."""
        for shard, stats in enumerate(every):
            self.metrics.shard_copies.labels(shard=str(shard)).set(stats.get("copies", 0))
            self.metrics.shard_primary.labels(shard=str(shard)).set(stats.get("copy", 0))
            self.metrics.shard_failovers.labels(shard=str(shard)).set(stats.get("failovers", 0))

    def _record_rows(self, every: list[dict]) -> None:
        """Every shard's embedding rows: the fullest shard's, the budget, and the rows refused
        and evicted for want of room, over all shards."""
        stats = [s for s in every if "rows" in s]
        if not stats:
            return
        figures = {"max": max(s["rows"] for s in stats), "budget": max(s.get("rowBudget", 0) for s in stats),
                   "refused": sum(s.get("rowsRefused", 0) for s in stats),
                   "evicted": sum(s.get("rowsEvicted", 0) for s in stats)}
        for figure, value in figures.items():
            self.metrics.rows.labels(figure=figure).set(value)

    def _finish(self, reason: str, outcome: str, *, step: int, loss: float, accuracy: float, elapsed: float,
                auc: float | None) -> None:
        held_out = self.record.as_dict()
        degraded = degradation(held_out)
        if degraded:
            self.metrics.degraded.labels(reason=degraded[0], message=degraded[1]).set(1)
            log.warning("event=model_degraded reason=%s message=%r", *degraded)
            if self.fail_on_degraded:
                reason, outcome = contract.MODEL_DEGRADED, FAILED
        lost = {str(shard): n for shard, n in sorted(self.updates_lost.items()) if n}
        if lost and self.fail_on_updates_lost:
            reason, outcome = UPDATES_LOST, FAILED
        self.metrics.finished.labels(reason=reason, outcome=outcome).set(1)
        examples = self.training()["examples"]
        result = {"phase": outcome, "reason": reason, "globalStep": step,
                  "loss": loss if np.isfinite(loss) else None, "accuracy": accuracy,
                  "examples": examples, "examplesPerSecond": examples / elapsed if elapsed > 0 else 0.0,
                  "trainingSeconds": round(elapsed, 3), "finishedAt": time.time(), "heldOut": held_out,
                  **{k: v for k, v in self.more_figures().items() if k == "epoch"}}
        if auc is not None:
            result["auc"] = auc
        if degraded:
            result["degraded"] = {"reason": degraded[0], "message": degraded[1]}
        if lost:
            result["updatesLost"] = lost
        if self.keep_best and os.path.exists(os.path.join(self.output_dir, contract.BEST_PARAMS_FILE)):
            result["best"] = {"step": held_out["bestStep"], held_out["metric"]: held_out["best"],
                              "params": contract.BEST_PARAMS_FILE}
        state = self.optimizer_state()
        if state:
            result["objective"] = state.get("objective")  # the training objective L-BFGS reached
        self.scorer.save(os.path.join(self.output_dir, contract.PARAMS_FILE))
        path = os.path.join(self.output_dir, contract.RESULT_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        os.replace(path + ".tmp", path)
        log.info("event=job_done reason=%s outcome=%s step=%d accuracy=%.4f", reason, outcome, step, accuracy)
        self.group.done(reason, outcome)
