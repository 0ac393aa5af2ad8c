"""Training curves of local runs: what the chief's history.jsonl does not hold, and the plot.

The chief records one line per held-out evaluation (history.jsonl, beside its
checkpoints). Local mode adds curves.jsonl in the output folder: shard 0's training loss
(the moving average of the replicas' minibatch losses) and examples/s, their mean per
replica and each replica's own rate (from its examples counter), about once a second;
and a `start` line at each run's start, so that a plot marks where a run resumed.

    training.png   loss (training and held-out), held-out accuracy, examples/s over steps
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping, Sequence

from distbelief.operator.status.scrape import Figures

CURVES_FILE = "curves.jsonl"
RECORD_EVERY_SECONDS = 1.0


class Recorder:
    """Appends the training figures of one run to curves.jsonl."""

    def __init__(self, output: str, *, resumed_at: int) -> None:
        self.path = os.path.join(output, CURVES_FILE)
        self._last = 0.0
        self._examples: dict[str, tuple[float, int]] = {}  # replica -> (time, examples) at the last record
        self._append({"time": time.time(), "event": "start", "step": resumed_at})

    def record(self, figures: Figures, replicas: Mapping[str, Figures]) -> None:
        """figures: shard 0's; replicas: each running replica's own, by pod name."""
        now = time.time()
        if not figures.reachable or not figures.train_loss or now - self._last < RECORD_EVERY_SECONDS:
            return  # (the shard's training loss reads 0 until it applied a push)
        self._last = now
        rate = figures.examples_per_second or 0.0
        self._append({"time": now, "step": figures.global_step, "trainLoss": figures.train_loss,
                      "examplesPerSecond": rate, "replicas": len(replicas),
                      "examplesPerSecondPerReplica": rate / len(replicas) if replicas else 0.0,
                      "replicaExamplesPerSecond": self._replica_rates(now, replicas)})

    def _replica_rates(self, now: float, replicas: Mapping[str, Figures]) -> dict[str, float]:
        """Each replica's examples/s since the last record (from its examples counter)."""
        rates = {}
        for name, seen in replicas.items():
            if seen.replica_examples is None:
                continue
            before = self._examples.get(name)
            self._examples[name] = (now, seen.replica_examples)
            if before and seen.replica_examples >= before[1] and now > before[0]:
                rates[name] = round((seen.replica_examples - before[1]) / (now - before[0]), 1)
        return rates

    def _append(self, row: Mapping[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def read(output: str) -> list[dict[str, Any]]:
    return read_json_lines(os.path.join(output, CURVES_FILE))


def read_json_lines(path: str) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file; none if it is absent, and never a line cut short by a crash."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return rows


def figure(history: Sequence[Mapping[str, Any]], curves: Sequence[Mapping[str, Any]], *, title: str) -> Any:
    """The matplotlib figure: loss, accuracy and examples/s over global steps, a dashed
    line where a run resumed from checkpoints."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    resumed = [row["step"] for row in curves if row.get("event") == "start" and row.get("step")]
    fig, (ax_loss, ax_acc, ax_rate) = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    ax_loss.plot([r["step"] for r in history], [r["loss"] for r in history], color="tab:red", marker=".",
                 label="held-out")
    ax_acc.plot([r["step"] for r in history], [r["accuracy"] for r in history], color="tab:blue", marker=".")
    for run, training in enumerate(_runs(curves)):  # each run's lines apart: no line across a resume
        label = (lambda text: text) if run == 0 else (lambda text: f"_{text}")
        steps = [r["step"] for r in training]
        ax_loss.plot(steps, [r["trainLoss"] for r in training], color="tab:orange",
                     label=label("training (moving average)"))
        ax_rate.plot(steps, [r["examplesPerSecond"] for r in training], color="tab:green", label=label("all replicas"))
        ax_rate.plot(steps, [r["examplesPerSecondPerReplica"] for r in training], color="tab:olive",
                     label=label("per replica (mean)"))
        for name in sorted({name for r in training for name in r.get("replicaExamplesPerSecond", {})}):
            own = [r for r in training if name in r.get("replicaExamplesPerSecond", {})]
            ax_rate.plot([r["step"] for r in own], [r["replicaExamplesPerSecond"][name] for r in own],
                         linewidth=0.7, alpha=0.6, label=f"_{name}")
    ax_loss.set(xlabel="global step", ylabel="loss", yscale="log", title="Loss")
    ax_acc.set(xlabel="global step", ylabel="held-out accuracy", ylim=(0, 1), title="Accuracy")
    ax_rate.set(xlabel="global step", ylabel="examples/s", title="Throughput")
    for ax in (ax_loss, ax_rate):
        if ax.get_legend_handles_labels()[0]:  # a run with no training figures has no lines to name
            ax.legend()
    for ax in (ax_loss, ax_acc, ax_rate):
        ax.grid(alpha=0.3)
        for step in resumed:
            ax.axvline(step, color="gray", linestyle="--", linewidth=1, label="_resumed")
    fig.suptitle(title + (f" (resumed at step {', '.join(map(str, resumed))})" if resumed else ""))
    return fig


def _runs(curves: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """The training rows of each run (split at the start lines), runs without rows left out."""
    runs: list[list[Mapping[str, Any]]] = [[]]
    for row in curves:
        if row.get("event") == "start":
            runs.append([])
        elif "trainLoss" in row:
            runs[-1].append(row)
    return [run for run in runs if run]


def plot(history: Sequence[Mapping[str, Any]], curves: Sequence[Mapping[str, Any]], path: str, *, title: str) -> None:
    fig = figure(history, curves, title=title)
    import matplotlib.pyplot as plt  # after figure() chose the Agg backend

    fig.savefig(path, dpi=100)
    plt.close(fig)
