"""What local mode shows and leaves behind: the live progress bar and the final report.

Progress comes from the chief's Prometheus endpoint, exactly as the operator reads it;
the report from the files the chief writes beside its checkpoints (result.json,
history.jsonl, params.npz), so nothing here depends on a process still running.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from typing import Any, Mapping

from tqdm import tqdm

from distbelief.operator.local import curves
from distbelief.operator.local.podusage import OOM_KILLED
from distbelief.operator.status import scrape
from distbelief.operator.status.status import MODEL_DEGRADED, ROW_BUDGET_REACHED, UPDATES_LOST, WARNINGS

from distbelief.runtime import contract

log = logging.getLogger(__name__)

REPORT_FILE, PLOT_FILE = "report.json", "training.png"
SCRAPE_TIMEOUT = 0.5


class Progress:
    """A progress bar over global steps, with loss, accuracy and examples/s beside it (and
    a Sandblaster job's objective)."""

    def __init__(self, job: str, *, total: int, enabled: bool, initial: int = 0) -> None:
        tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=min(initial, total), desc=job, unit="step", disable=not enabled,
                        dynamic_ncols=True, mininterval=0.2 if tty else 10.0, file=sys.stderr)

    def update(self, figures: scrape.Figures, *, evaluated: bool) -> None:
        """Show the chief's figures (shard 0's metrics); evaluated: whether the chief has
        scored the parameters yet in this run (its loss and accuracy mean nothing before)."""
        if not figures.reachable:
            return
        self.bar.update(max(0, min(figures.global_step, self.bar.total) - self.bar.n))
        self.bar.set_postfix_str(postfix(figures, evaluated=evaluated), refresh=False)

    def close(self) -> None:
        self.bar.close()


def postfix(figures: scrape.Figures, *, evaluated: bool) -> str:
    """The text beside the bar: held-out figures once there are some, and examples/s."""
    rate = f"ex/s={_or(figures.examples_per_second, 0.0):,.0f}"
    if not evaluated:
        return f"waiting for the first evaluation {rate}"
    nan = float("nan")
    objective = "" if figures.objective is None else f"objective={figures.objective:.5g} "
    return f"{objective}loss={_or(figures.loss, nan):.4f} acc={_or(figures.accuracy, nan):.4f} {rate}"


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def read_result(chief_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(chief_dir, contract.RESULT_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_history(chief_dir: str) -> list[dict[str, Any]]:
    return curves.read_json_lines(os.path.join(chief_dir, contract.HISTORY_FILE))


def write(output: str, chief_dir: str, *, job: str, phase: str, reason: str, started: float,
          pods: Mapping[str, Mapping[str, Any]], staleness: Mapping[str, float] | None = None,
          shards: Mapping[str, Any] | None = None,
          conditions: list[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """report.json, training.png and params.npz (and params-best.npz) in output; returns the
    report. Its figures are this run's (since `started`): never an earlier run's, when this
    one evaluated nothing. pods: each pod's figures (LocalPod.figures), restarts among them;
    conditions: the job's status conditions, whose warnings (ModelDegraded,
    RowBudgetReached) the report lists."""
    result = read_result(chief_dir) or {}
    if result.get("finishedAt", 0) < started:
        result = {}
    history = read_history(chief_dir)
    ours = [row for row in history if row.get("time", 0) >= started]
    last = ours[-1] if ours else {}
    summary = {
        "job": job, "phase": phase, "reason": reason,
        "globalStep": result.get("globalStep", last.get("step", 0)),
        "loss": result.get("loss", last.get("loss")),
        "accuracy": result.get("accuracy", last.get("accuracy")),
        "examplesPerSecond": result.get("examplesPerSecond", last.get("examplesPerSecond", 0.0)),
        "examples": result.get("examples"),
        "trainingSeconds": result.get("trainingSeconds"),
        "wallSeconds": round(time.time() - started, 3),
        "restarts": sum(pod["restarts"] for pod in pods.values()),
        "restartsByPod": {name: pod["restarts"] for name, pod in pods.items()},
        "evaluations": len(ours),
        "staleness": dict(staleness) if staleness else None,
        "pods": {name: dict(pod) for name, pod in pods.items()},
    }
    if shards:
        summary["shards"] = dict(shards)  # with backups: each shard's copies, primary and failovers
    epoch = result.get("epoch", last.get("epoch"))
    if epoch is not None:
        summary["epoch"] = epoch  # epochs of a streamed file source the replicas finished
    auc = result.get("auc", last.get("auc"))
    if auc is not None:
        summary["auc"] = auc  # two-class jobs
    for key in ("heldOut", "degraded", "best"):  # the held-out record, the verdict on it, keepBest's
        if result.get(key):
            summary[key] = result[key]
    warnings = [{k: c[k] for k in ("type", "reason", "message") if k in c} for c in conditions or []
                if c.get("type") in WARNINGS and c.get("status") == "True"]
    if warnings:
        summary["warnings"] = warnings
    for name, key in ((contract.PARAMS_FILE, "params"), (contract.BEST_PARAMS_FILE, "paramsBest")):
        path = os.path.join(chief_dir, name)
        if result and os.path.exists(path):
            shutil.copyfile(path, os.path.join(output, name))
            summary[key] = name
    if history:
        curves.plot(history, curves.read(output), os.path.join(output, PLOT_FILE), title=f"{job}: {phase}")
        summary["plot"] = PLOT_FILE
    with open(os.path.join(output, REPORT_FILE), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return summary


def print_summary(summary: Mapping[str, Any], output: str) -> None:
    """The user-facing end of `distbelief run` (stdout: this is the command's result)."""
    accuracy = summary.get("accuracy")
    loss = summary.get("loss")
    lines = [
        f"{summary['job']}: {summary['phase']} ({summary['reason']})",
        f"  global step        {summary['globalStep']}",
        f"  held-out accuracy  {accuracy:.4f}" if accuracy is not None else "  held-out accuracy  -",
        f"  held-out loss      {loss:.4f}" if loss is not None else "  held-out loss      -",
        *([f"  held-out AUC       {summary['auc']:.4f}"] if summary.get("auc") is not None else []),
        *_held_out_lines(summary),
        f"  examples/s         {summary['examplesPerSecond']:,.0f}",
        f"  wall time          {summary['wallSeconds']:.1f} s, restarts {summary['restarts']}",
        *[f"  {OOM_KILLED:<19}{name} {pod['oomKills']}x, over its memory limit {pod['memoryLimit']}"
          for name, pod in summary["pods"].items() if pod.get("oomKills")],
        f"  report             {os.path.join(output, REPORT_FILE)}",
    ]
    sys.stdout.write("\n".join(lines) + "\n")


WARNING_LABELS = {MODEL_DEGRADED: "MODEL DEGRADED", ROW_BUDGET_REACHED: "ROW BUDGET", UPDATES_LOST: "UPDATES LOST"}


def _held_out_lines(summary: Mapping[str, Any]) -> list[str]:
    """The best evaluation when keepBest saved it, a diverged held-out loss, and the warnings."""
    lines = []
    best = summary.get("best")
    if best:
        metric = next(k for k in best if k not in ("step", "params"))
        lines.append(f"  best               {metric} {best[metric]:.4f} at step {best['step']} ({best['params']})")
    diverged = (summary.get("heldOut") or {}).get("diverged")
    degraded = summary.get("degraded") or {}
    if diverged and degraded.get("reason") != "HeldOutLossDiverged":
        to = diverged["to"]
        lines.append(f"  held-out loss      went from {diverged['from']:.4g} to "
                     f"{'a non-finite value' if to is None else format(to, '.4g')} at step {diverged['step']}")
    for warning in summary.get("warnings", []):
        lines.append(f"  {WARNING_LABELS.get(warning['type'], warning['type']):<19}{warning.get('message', '')}")
    return lines
