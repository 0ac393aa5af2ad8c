"""The arithmetic make bench publishes: steady-state rates and times from a job's history,
the target ratios, and the plot (the measurements themselves only run in make bench)."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import e2e_bench  # noqa: E402
import plot_results  # noqa: E402
import run_all  # noqa: E402


def figure(median: float) -> dict:
    return {"median": median, "min": median * 0.9, "max": median * 1.1, "runs": [median]}


HISTORY = [  # start-up (elapsed < WARMUP_S) is left out of the rate
    {"time": 100.0, "elapsed": 1.0, "examples": 0, "accuracy": 0.5},
    {"time": 101.5, "elapsed": 2.5, "examples": 3_000, "accuracy": 0.9},
    {"time": 103.5, "elapsed": 4.5, "examples": 23_000, "accuracy": 0.96},
    {"time": 104.5, "elapsed": 5.5, "examples": 33_000, "accuracy": 0.97},
]


def test_steady_rate_counts_only_the_window_after_warm_up() -> None:
    assert e2e_bench.steady_rate(HISTORY) == pytest.approx(30_000 / 3.0)


def test_time_to_accuracy_runs_from_launch_to_the_first_evaluation_at_target() -> None:
    assert e2e_bench.seconds_to_target(99.0, HISTORY) == pytest.approx(4.5)


def test_target_ratios_say_which_targets_are_missed() -> None:
    results = {"memcpy_gbps": figure(10.0), "apply_gbps": figure(3.0), "pull_gbps": figure(2.5),
               "push_gbps": figure(2.0), "mlp_step_ms": {"distbelief": figure(3.0), "torch": figure(3.3)},
               "examples_per_s": {"distbelief": figure(11_000), "distbelief_unencrypted": figure(15_000),
                                  "torch_rpc_ps": figure(10_000), "torch_ddp_gloo": figure(18_000)}}
    rows = {r["figure"]: r for r in run_all.target_ratios(results)}
    assert rows["apply / memcpy"]["ratio"] == pytest.approx(0.3) and not rows["apply / memcpy"]["met"]
    assert rows["push / memcpy"]["met"] and rows["MLP step distbelief / torch"]["met"]
    assert rows["examples/s distbelief / torch RPC PS"]["met"]
    assert not rows["examples/s distbelief / torch DDP gloo"]["met"]
    assert rows["examples/s unencrypted / torch DDP gloo"]["ratio"] == pytest.approx(15 / 18)
    assert rows["examples/s unencrypted / torch DDP gloo"]["met"]


def test_the_plot_draws_what_results_hold(tmp_path) -> None:
    out = tmp_path / "bench.png"
    plot_results.plot({"memcpy_gbps": figure(10.0), "examples_per_s": {"distbelief": figure(1e4)}}, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
