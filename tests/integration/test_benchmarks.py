"""The arithmetic make bench publishes: steady-state rates and times from a job's history,
parallel efficiency, the target ratios, the retry-and-record of crashed runs, the summary,
the MNIST-sized set and the plot (the measurements themselves only run in make bench)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from support.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import chief_scale
import dispenser_scale
import e2e_bench
import figures
import heavy_tail_bench
import mnist_sized
import plot_results
import reshard_bench
import sandblaster_scale
import run_all
import sparse_table_bench

from distbelief.operator.validation import spec
from distbelief.runtime.model import data


def figure(median: float) -> dict:
    return {"median": median, "min": median * 0.9, "max": median * 1.1, "runs": [median]}


FAILED = figures.summarize([None, None])

HISTORY = [  # start-up (elapsed < WARMUP_S) is left out of the rate
    {"time": 100.0, "elapsed": 1.0, "examples": 0, "accuracy": 0.5},
    {"time": 101.5, "elapsed": 2.5, "examples": 3_000, "accuracy": 0.9},
    {"time": 103.5, "elapsed": 4.5, "examples": 23_000, "accuracy": 0.96},
    {"time": 104.5, "elapsed": 5.5, "examples": 33_000, "accuracy": 0.97},
]


def crash(code: int) -> None:
    """A child process that dies with exit code `code` (negative: of that signal)."""
    body = f"import os, signal; os.kill(os.getpid(), {-code})" if code < 0 else f"raise SystemExit({code})"
    subprocess.run([sys.executable, "-c", body], check=True)


def test_steady_rate_counts_only_the_window_after_warm_up() -> None:
    assert e2e_bench.steady_rate(HISTORY) == pytest.approx(30_000 / 3.0)
    assert e2e_bench.steady_rate(HISTORY, warmup_s=4.0) == pytest.approx(10_000 / 1.0)


def test_a_history_too_short_for_a_rate_is_a_failed_run() -> None:
    failures: list[dict] = []
    assert figures.retried("short", lambda: e2e_bench.steady_rate(HISTORY, warmup_s=5.0), failures) is None
    assert failures[0]["exit_code"] is None and "1 evaluation(s) after 5.0 s" in failures[0]["reason"]


def test_time_to_accuracy_runs_from_launch_to_the_first_evaluation_at_target() -> None:
    assert e2e_bench.seconds_to_target(99.0, HISTORY) == pytest.approx(4.5)
    assert e2e_bench.seconds_to_target(99.0, HISTORY, target=0.9) == pytest.approx(2.5)


def test_efficiency_is_the_job_rate_over_cores_times_one_process() -> None:
    assert e2e_bench.efficiency(22_000, 55_000, 2) == pytest.approx(0.2)
    assert e2e_bench.efficiency(22_000, 55_000, 1) == pytest.approx(0.4)
    # only runs whose job and baseline both produced a rate are paired
    assert e2e_bench.paired_efficiency([10.0, None, 30.0, 40.0], [10.0, 20.0, None, 20.0], 2) == \
        pytest.approx([0.5, 1.0])


def test_workload_jobs_are_valid_and_keep_the_fixed_settings() -> None:
    settings = {"compute_bound": ([512, 512], 128, 1), "communication_bound": ([256, 128], 32, 2),
                "large_dense": ([10000, 8000], 32, 1)}
    for name, w in e2e_bench.WORKLOADS.items():
        job = e2e_bench.workload_job(name, w, scale=0.1)
        training = job["spec"]["training"]
        assert (job["spec"]["model"]["hiddenLayers"], training["batchSize"], training["pushEvery"]) == settings[name]
        assert training["fetchEvery"] == training["pushEvery"]
        assert training["maxSteps"] == max(1, round(w.steps * 0.1))
        spec.validate_job(job)  # raises on a job the CRD or the rules refuse
    sizes = [1000, *e2e_bench.WORKLOADS["large_dense"].hidden, 10]
    assert sum(a * b + b for a, b in zip(sizes, sizes[1:])) >= 90_000_000


def test_each_job_is_divided_by_the_baseline_measured_beside_it(monkeypatch) -> None:
    jobs = iter([30_000.0, 40_000.0, 33_000.0, 20_000.0, 25_000.0, 22_000.0])  # per run: job, unencrypted, overlap
    baselines = iter([10_000.0, None, None])  # run 2's baseline crashes on both attempts

    def baseline(spec: dict, seconds: float) -> float:
        rate = next(baselines)
        if rate is None:
            crash(-6)
        return rate
    monkeypatch.setattr(e2e_bench, "job_rate", lambda job, warmup_s: lambda run: next(jobs))
    monkeypatch.setattr(e2e_bench, "baseline_rate", baseline)
    failures: list[dict] = []
    out = e2e_bench.measure_examples(2, 1.0, 2, failures)
    assert out["examples_per_s"]["distbelief"]["runs"] == [30_000.0, 20_000.0]
    assert out["examples_per_s"]["distbelief_unencrypted"]["runs"] == [40_000.0, 25_000.0]
    assert out["examples_per_s"]["distbelief_overlap"]["runs"] == [33_000.0, 22_000.0]
    figure = out["efficiency"]["compute_bound"]
    assert figure["runs"] == [pytest.approx(1.5)]  # run 2 has no baseline: no efficiency
    assert out["efficiency_overlap"]["compute_bound"]["runs"] == [pytest.approx(1.65)]  # the same baseline
    assert figure["single_process_examples_per_s"]["runs"] == [10_000.0]
    assert (figure["cores"], figure["batch"], figure["fetch_push_every"]) == (2, 128, 1)
    assert [f["run"] for f in failures] == ["e2e compute_bound_single_process run 2"]


def test_bfloat16_efficiency_is_divided_by_the_baselines_of_the_float32_runs_beside_it(monkeypatch) -> None:
    rates = {"float32": 10_000.0, "bfloat16": 15_000.0}
    formats = []

    def job_rate(job: dict, warmup_s: float):
        spec.validate_job(job)
        formats.append(job["spec"]["parameterServers"]["wireFormat"])
        return lambda run, fmt=formats[-1]: rates[fmt]
    monkeypatch.setattr(e2e_bench, "job_rate", job_rate)
    monkeypatch.setattr(e2e_bench, "baseline_rate", lambda spec, seconds: 5_000.0)
    out = e2e_bench.measure_efficiency(1, 0.1, 2, [])
    assert sorted(formats) == ["bfloat16", "bfloat16", "float32", "float32"]
    for name in ("communication_bound", "large_dense"):
        assert out["efficiency"][name]["runs"] == [pytest.approx(1.0)]
        assert out["efficiency_bfloat16"][name]["runs"] == [pytest.approx(1.5)]
        assert out["efficiency_bfloat16"][name]["batch"] == e2e_bench.WORKLOADS[name].batch


def test_the_wire_accuracy_figure_runs_one_job_in_each_format_for_the_same_steps(monkeypatch) -> None:
    accuracy = {"float32": 0.95, "bfloat16": 0.94}
    jobs = []

    def run_job(job: dict):
        jobs.append(job)
        fmt = job["spec"]["parameterServers"]["wireFormat"]
        return 0.0, [{"accuracy": 0.1}, {"accuracy": accuracy[fmt]}]  # the last evaluation is the final one
    monkeypatch.setattr(e2e_bench, "run_job", run_job)
    out = e2e_bench.measure_wire_accuracy(2, [])["accuracy_bfloat16"]
    assert out["float32"]["runs"] == [0.95, 0.95] and out["bfloat16"]["runs"] == [0.94, 0.94]
    assert out["difference"]["median"] == pytest.approx(-0.01)
    for job in jobs:
        training = spec.validate_job(job)["spec"]["training"]
        assert training["maxSteps"] == e2e_bench.WIRE_ACCURACY_STEPS and "targetAccuracy" not in training


def test_a_crashed_run_is_retried_once_then_recorded_with_its_exit_code() -> None:
    calls, failures = [], []
    assert figures.retried("peer run 3", lambda: calls.append(1) or crash(-6), failures) is None
    assert len(calls) == 2
    assert [(f["run"], f["exit_code"], f["attempts"]) for f in failures] == [("peer run 3", -6, 2)]


def test_a_run_that_crashes_once_keeps_the_value_of_its_retry() -> None:
    outcomes, failures = iter([lambda: crash(3), lambda: 42.0]), []
    assert figures.retried("flaky", lambda: next(outcomes)(), failures) == 42.0
    assert failures == []


def test_a_run_that_overruns_is_recorded_without_an_exit_code() -> None:
    def overrun() -> None:
        subprocess.run([sys.executable, "-c", "import time; time.sleep(5)"], timeout=0.1, check=True)
    failures: list[dict] = []
    figures.retried("slow", overrun, failures)
    assert [(f["run"], f["exit_code"]) for f in failures] == [("slow", None)]
    assert "timed out" in failures[0]["reason"]


def test_a_failing_measure_leaves_the_others_figures_in_place() -> None:
    failures: list[dict] = []
    values = figures.interleaved(2, {"ok": lambda run: 10.0 + run, "peer": lambda run: crash(1)}, failures)
    assert values == {"ok": [10.0, 11.0], "peer": [None, None]}
    assert [f["run"] for f in failures] == ["peer run 1", "peer run 2"]
    assert figures.summarize(values["ok"])["median"] == pytest.approx(10.5)
    assert figures.summarize(values["peer"]) == FAILED and figures.fmt(FAILED) == "failed"


def test_a_script_that_crashes_twice_is_recorded_and_the_bench_goes_on(tmp_path, monkeypatch) -> None:
    (tmp_path / "broken.py").write_text("import os\nos.abort()\n")
    (tmp_path / "fine.py").write_text("import json, sys\nopen(sys.argv[-1], 'w').write(json.dumps({'x': 1}))\n")
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    failures: list[dict] = []
    assert run_all.run_json("broken.py", failures) == {}
    assert run_all.run_json("fine.py", failures) == {"x": 1}
    assert [(f["run"], f["exit_code"], f["attempts"]) for f in failures] == [("broken.py", -6, 2)]


def test_target_ratios_say_which_targets_are_missed() -> None:
    results = {"memcpy_gbps": figure(10.0), "apply_gbps": figure(3.0), "pull_gbps": figure(2.5),
               "push_gbps": figure(2.0), "pull_gbps_encrypted": figure(2.6), "push_gbps_encrypted": figure(1.5),
               "mlp_step_ms": {"distbelief": figure(3.0), "torch": figure(3.3)},
               "examples_per_s": {"distbelief": figure(11_000), "distbelief_unencrypted": figure(15_000),
                                  "torch_rpc_ps": figure(10_000), "torch_ddp_gloo": figure(18_000)},
               "efficiency": {"compute_bound": figure(0.61), "communication_bound": figure(0.2)},
               "aes_gcm_bound_gbps": figure(5.0),
               "sparse_peers": {"examples_per_s_ratio": figure(0.45), "auc_difference": figure(0.05)},
               "peer_rounds": {"ratios": {"distbelief_over_tf_ps_best": figure(1.5)},
                               "cpu_cost": {"compute_bound": figure(2.1), "compute_bound_every4": figure(1.1)}},
               "time_to_accuracy_mnist_s": {"distbelief": figure(4.0), "single_process": figure(1.0),
                                            "torch_ddp_gloo": FAILED}}
    rows = {r["figure"]: r for r in run_all.target_ratios(results)}
    assert rows["apply / memcpy"]["ratio"] == pytest.approx(0.3) and not rows["apply / memcpy"]["met"]
    assert rows["pull unencrypted / memcpy"]["met"] and not rows["push unencrypted / memcpy"]["met"]  # 0.25, 0.2
    assert rows["pull / memcpy"]["ratio"] == pytest.approx(0.26) and rows["pull / memcpy"]["met"]  # encrypted
    assert rows["push / memcpy"]["ratio"] == pytest.approx(0.15) and not rows["push / memcpy"]["met"]
    assert rows["MLP step distbelief / torch"]["met"]
    # Peers measured one after the other, and the parallel efficiency: figures without targets.
    assert rows["examples/s unencrypted / torch DDP gloo"]["ratio"] == pytest.approx(15 / 18)
    assert rows["examples/s distbelief / torch DDP gloo"]["met"] is None
    assert rows["efficiency, compute-bound"]["ratio"] == pytest.approx(0.61)
    assert rows["efficiency, compute-bound"]["met"] is None
    # The interleaved rounds' ratios are taken as they are, against their bounds.
    assert rows["examples/s distbelief / TF PS strategy, best"]["ratio"] == pytest.approx(1.5)
    assert not rows["examples/s distbelief / TF PS strategy, best"]["met"]
    assert rows["CPU cost, compute-bound, every 4"]["met"] and not rows["CPU cost, compute-bound"]["met"]
    assert rows["pull encrypted / AES-GCM bound"]["ratio"] == pytest.approx(0.52)
    assert rows["pull encrypted / AES-GCM bound"]["met"] and not rows["push encrypted / AES-GCM bound"]["met"]
    assert rows["AUC sparse distbelief - TorchRec"]["met"]  # a difference held to >= 0, not a ratio
    assert not rows["examples/s sparse distbelief / TorchRec"]["met"]
    missing = rows["examples/s distbelief / torch DDP, rounds"]  # no figure: no ratio, and the target is not met
    assert missing["ratio"] is None and missing["met"] is False
    assert rows["time to 0.94 distbelief / one process"]["ratio"] == pytest.approx(4.0)
    assert rows["time to 0.94 distbelief / one process"]["met"] is None  # no target
    assert rows["time to 0.94 distbelief / torch DDP gloo"]["ratio"] is None  # the peer's runs failed


def test_the_summary_names_every_failed_run() -> None:
    results = {"examples_per_s": {"distbelief": figure(1e4), "torch_ddp_gloo": FAILED},
               "failures": [{"run": "torch torch_ddp_gloo run 2", "exit_code": -6, "attempts": 2,
                             "reason": "ddp_examples (exit codes [-6, 0]): exit code -6"}]}
    results["targets"] = run_all.target_ratios(results)
    lines = run_all.summary(results)
    assert "FAILED torch torch_ddp_gloo run 2: exit code -6 after 2 attempts " \
           "(ddp_examples (exit codes [-6, 0]): exit code -6)" in lines
    assert lines[-1] == "1 run(s) failed"
    assert any(line.startswith("examples/s distbelief / torch DDP gloo") and "failed" in line for line in lines)
    assert run_all.summary({**results, "failures": []})[-1] == "no run failed"


def test_merge_puts_our_jobs_beside_the_peers_and_skips_what_neither_measured() -> None:
    ours = {"examples_per_s": {"distbelief": figure(1.0)}, "time_to_accuracy_mnist_s": {"distbelief": figure(2.0)}}
    peers = {"examples_per_s": {"torch_ddp_gloo": figure(3.0)}}
    merged = run_all.merge(ours, peers)
    assert set(merged) == {"examples_per_s", "time_to_accuracy_mnist_s"}
    assert set(merged["examples_per_s"]) == {"distbelief", "torch_ddp_gloo"}
    assert run_all.merge({}, {}) == {}


def test_the_mnist_sized_set_holds_out_source_images_the_training_part_never_saw() -> None:
    x, y, source = mnist_sized.build(samples=1400)
    assert x.shape == (1400, 784) and x.dtype == np.float32 and set(np.unique(y)) == set(range(10))
    split = data.split(source[:, None].astype(np.float32), y, test_fraction=mnist_sized.TEST_FRACTION, seed=0)
    assert len(split.x_test) == 200
    assert not set(split.x_test[:, 0]) & set(split.x_train[:, 0])


def test_the_plot_draws_what_results_hold(tmp_path) -> None:
    out = tmp_path / "bench.png"
    plot_results.plot({"memcpy_gbps": figure(10.0), "examples_per_s": {"distbelief": figure(1e4)},
                       "efficiency": {"compute_bound": figure(0.3), "large_dense": FAILED}}, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_bench_fills_real_shard_processes_and_reads_their_memory() -> None:
    """A small table through the same path as the 800M-parameter figure: every pushed key is
    a row in a shard process, and the figures are read from those processes."""
    result = sparse_table_bench.measure(rows=30_000, dim=4, shards=2)
    assert result["rows"] == 30_000 and result["params"] == 120_000
    assert len(result["rss_bytes_per_shard"]) == 2
    assert result["rss_bytes_total"] == sum(result["rss_bytes_per_shard"]) > result["idle_rss_bytes_total"] > 0
    assert result["peak_rss_bytes_total"] >= result["rss_bytes_total"]
    assert result["fill_rows_per_s"] > 0


def test_the_input_speed_target_divides_by_the_compute_bound_jobs_replicas():
    results = {"examples_per_s": {"distbelief": figure(26_000.0)},
               "efficiency": {"compute_bound": {**figure(0.4), "replicas": 2}},
               "data": {"input_examples_per_s": figure(39_000.0)}}
    results["examples_per_replica_s"] = run_all.per_replica(results)
    assert results["examples_per_replica_s"]["compute_bound"]["median"] == 13_000.0
    row = next(r for r in run_all.target_ratios(results) if r["figure"].startswith("input examples/s"))
    assert row["ratio"] == 3.0 and row["met"] is True
    assert run_all.per_replica({"examples_per_s": {}}) == {}


def test_the_logistic_regression_reference_gives_unseen_and_missing_ids_no_column() -> None:
    from scipy import sparse as sp
    train = np.array([[5, 7], [9, -1], [5, 8]])
    columns = heavy_tail_bench.one_hot_columns(train)
    assert [c.tolist() for c in columns] == [[5, 9], [7, 8]]
    test = heavy_tail_bench.one_hot(np.array([[9, 8], [6, -1], [-1, 7]]), columns, sp).toarray()
    assert test.tolist() == [[0, 1, 0, 1], [0, 0, 0, 0], [0, 0, 1, 0]]  # 6: unseen; -1: missing


def test_the_dispenser_bench_serves_every_replica_thread_over_the_client_processes() -> None:
    """Three replicas over two client processes against a dispenser process of its own:
    asks answered in the window, their latencies, and both sides' CPU read from /proc."""
    row = dispenser_scale.measure(replicas=3, clients=2, seconds=0.5)
    assert row["replicas"] == 3 and row["asks_per_s"] > 10, row
    assert 0 < row["ask_ms_p50"] <= row["ask_ms_p99"], row
    assert row["dispenser_cores"] > 0 and row["clients_cores"] > 0, row


@pytest.mark.parametrize("rows", [False, True])
def test_the_reshard_bench_times_the_product_s_reshard_against_one_write_and_read(rows: bool) -> None:
    """Small folders through the same path as the 90M-parameter and 50M-row figures: the
    reshard completes (the run checks its announcement) and its ratio is of the times taken."""
    run = reshard_bench.one_run(20_000, 2, 3, seed=0, rows=rows)
    assert run["write_s"] > 0 and run["read_s"] > 0 and run["reshard_s"] > 0
    assert run["ratio"] == pytest.approx(run["reshard_s"] / (run["write_s"] + run["read_s"]))


def test_the_sandblaster_bench_runs_real_replicas_against_the_coordinator_and_reads_each_side_s_cpu() -> None:
    """Three replicas over two client processes against 2 shards and the coordinator of a
    process of their own: evaluations and units counted in the window, and the coordinator's
    thread's CPU apart from its process's."""
    row = sandblaster_scale.measure(replicas=3, clients=2, seconds=1.5, examples=4 * 3 * sandblaster_scale.UNIT)
    assert row["replicas"] == 3 and row["units_per_evaluation"] == 12, row
    assert row["evaluations_per_s"] > 0 and row["units_per_s"] >= 12 * row["evaluations_per_s"] * 0.5, row
    assert 0 < row["coordinator_cores"] <= row["shards_process_cores"] and row["replicas_cores"] > 0, row


def test_the_chief_bench_pushes_from_every_replica_thread_while_the_chief_evaluates() -> None:
    """Three replicas over two client processes against 2 shards and the chief of a process of
    their own: pushes answered in the window, the chief's evaluations in it, and the chief's
    thread's CPU apart from its process's."""
    row = chief_scale.measure(replicas=3, clients=2, seconds=1.5)
    assert row["replicas"] == 3 and row["pushes_per_s"] > 10, row
    assert 0 < row["push_ms_p50"] <= row["push_ms_p99"], row
    assert 1 <= row["evaluations"] <= row["evaluations_at_most"] + 1 and row["evaluation_ms_p50"] > 0, row
    assert row["chief_cores"] < row["shards_process_cores"] and row["replicas_cores"] > 0, row
