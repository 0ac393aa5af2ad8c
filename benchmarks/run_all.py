#!/usr/bin/env python
"""Every benchmark in one run, merged into one results file and one plot, with the target ratios.

    python benchmarks/run_all.py [--json benchmarks/results.json] [--plot docs/benchmarks.png] [--runs 5]

Runs, in this order, each in its own process: runtime_bench.py (memcpy, apply, pull,
push), mlp_step_bench.py, e2e_bench.py (our jobs in local mode, their one-process
baselines and parallel efficiency), torch_peers_bench.py (DDP gloo and an RPC parameter
server), peer_rounds.py (ours, torch's peers and TensorFlow's ParameterServerStrategy in
interleaved rounds, with the CPU each spends per example), sparse_bench.py and
sparse_table_bench.py (embedding rows), heavy_tail_bench.py (sparse jobs' AUC on click data
shaped like real logs), torchrec_peer.py (the larger click job against TorchRec for as
long), backups_bench.py (shard copies), copycheck.py (shard copies under faults: what is lost or applied twice),
takeover_window.py (how long a shard stands with fewer copies in sync after a takeover),
partition_bench.py (model-parallel replicas), staleness_bench.py (bounded staleness),
data_bench.py (a replica's memory and input speed on file sources), reshard_bench.py (a
dense job's and the 50M-row embedding table's checkpoints re-laid for another shard count),
fanout_bench.py (a push's cost per shard, 1 to 64 shards), dispenser_scale.py (the data
dispenser's asks a second at 1 to 256 replicas), sandblaster_scale.py (Sandblaster's
coordinator at 1 to 256 replicas), chief_scale.py (shard 0's pushes and the chief's
evaluations at 1 to 256 replicas), operator_bench.py and
operator_scale.py (the operator at --operator-jobs jobs on KWOK's fake nodes: issue 40's
targets, printed with the others), shaped_scaling.py (examples/s against the shard count on
a real node whose pods' links are shaped, beside torch DDP; its plot docs/scale.png).
Their figures go into --json, written afresh: every figure in it is from this run; each is a
median with its min and max.

A run that crashes is retried once and then recorded under "failures" with its exit code,
and the bench goes on: inside the scripts, per job or peer run; here, per script. The
summary at the end names every failure.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import retried, summarize

HERE = Path(__file__).resolve().parent
FigurePath = tuple[str, ...]
TARGETS: list[tuple[str, FigurePath, FigurePath | None, float | None, str]] = [
    # (label, numerator, denominator (None: the figure is a ratio itself), bound (None: no target), "min" | "max")
    ("apply / memcpy", ("apply_gbps",), ("memcpy_gbps",), 0.35, "min"),
    # Pull and push as a job runs them by default (encrypted), then without keys.
    ("pull / memcpy", ("pull_gbps_encrypted",), ("memcpy_gbps",), 0.25, "min"),
    ("push / memcpy", ("push_gbps_encrypted",), ("memcpy_gbps",), 0.25, "min"),
    ("pull unencrypted / memcpy", ("pull_gbps",), ("memcpy_gbps",), 0.25, "min"),
    ("push unencrypted / memcpy", ("push_gbps",), ("memcpy_gbps",), 0.25, "min"),
    # Sparse: our click-data job against TorchRec for as long (torchrec_peer.py), round by round.
    ("examples/s sparse distbelief / TorchRec", ("sparse_peers", "examples_per_s_ratio"), None, 1.0, "min"),
    ("AUC sparse distbelief - TorchRec", ("sparse_peers", "auc_difference"), None, 0.0, "min"),
    # Encrypted pull and push against what one core's AES-256-GCM seal and open allow.
    ("pull encrypted / AES-GCM bound", ("pull_gbps_encrypted",), ("aes_gcm_bound_gbps",), 0.5, "min"),
    ("push encrypted / AES-GCM bound", ("push_gbps_encrypted",), ("aes_gcm_bound_gbps",), 0.5, "min"),
    ("MLP step distbelief / torch", ("mlp_step_ms", "distbelief"), ("mlp_step_ms", "torch"), 1.0, "max"),
    # Peers, interleaved round by round (peer_rounds.py): the median of the rounds' ratios.
    ("examples/s distbelief / TF PS strategy, best", ("peer_rounds", "ratios", "distbelief_over_tf_ps_best"), None,
     2.0, "min"),
    ("examples/s distbelief / torch DDP, rounds", ("peer_rounds", "ratios", "distbelief_over_torch_ddp"), None,
     1.3, "min"),
    ("examples/s distbelief / torch RPC PS, rounds", ("peer_rounds", "ratios", "distbelief_over_torch_rpc_ps"),
     None, 1.0, "min"),
    # CPU per 1,000 examples over one plain process's on the same model (1.0: distribution for free).
    ("CPU cost, compute-bound", ("peer_rounds", "cpu_cost", "compute_bound"), None, 1.5, "max"),
    ("CPU cost, compute-bound, every 4", ("peer_rounds", "cpu_cost", "compute_bound_every4"), None, 1.2, "max"),
    ("CPU distbelief / CPU torch DDP", ("peer_rounds", "ratios", "distbelief_cpu_over_torch_ddp_cpu"), None, 1.0,
     "max"),
    ("CPU cost, communication-bound", ("peer_rounds", "cpu_cost", "communication_bound"), None, None, "max"),
    ("CPU cost, large dense", ("peer_rounds", "cpu_cost", "large_dense"), None, None, "max"),
    # Measured one system after the other (torch_peers_bench.py, e2e_bench.py): figures kept,
    # their targets superseded by the interleaved ratios above.
    ("examples/s distbelief / torch RPC PS", ("examples_per_s", "distbelief"), ("examples_per_s", "torch_rpc_ps"),
     None, "min"),
    ("examples/s distbelief / torch DDP gloo", ("examples_per_s", "distbelief"),
     ("examples_per_s", "torch_ddp_gloo"), None, "min"),
    ("examples/s unencrypted / torch RPC PS", ("examples_per_s", "distbelief_unencrypted"),
     ("examples_per_s", "torch_rpc_ps"), None, "min"),
    ("examples/s unencrypted / torch DDP gloo", ("examples_per_s", "distbelief_unencrypted"),
     ("examples_per_s", "torch_ddp_gloo"), None, "min"),
    # Parallel efficiency: job examples/s / (cores x one plain process on one thread). Retired
    # as targets: five processes on 2 cores measure the machine, not the design.
    ("efficiency, compute-bound", ("efficiency", "compute_bound"), None, None, "min"),
    ("efficiency, compute-bound, overlapped", ("efficiency_overlap", "compute_bound"), None, None, "min"),
    ("examples/s overlapped / torch DDP gloo", ("examples_per_s", "distbelief_overlap"),
     ("examples_per_s", "torch_ddp_gloo"), None, "min"),
    ("efficiency, communication-bound", ("efficiency", "communication_bound"), None, None, "min"),
    ("efficiency, large dense", ("efficiency", "large_dense"), None, None, "min"),
    # Time to 0.94 on the MNIST-sized set: no target, the ratios to what a user could run instead.
    # A replica reading, shuffling and batching Parquet, against what one compute-bound replica trains on.
    ("input examples/s / compute-bound replica", ("data", "input_examples_per_s"),
     ("examples_per_replica_s", "compute_bound"), 2.0, "min"),
    ("time to 0.94 distbelief / one process", ("time_to_accuracy_mnist_s", "distbelief"),
     ("time_to_accuracy_mnist_s", "single_process"), None, "max"),
    ("time to 0.94 distbelief / torch DDP gloo", ("time_to_accuracy_mnist_s", "distbelief"),
     ("time_to_accuracy_mnist_s", "torch_ddp_gloo"), None, "max"),
    # Issue 39: a reshard of 90M parameters, and of the 50M-row embedding table, against writing
    # and reading one checkpoint of it.
    ("reshard 2->3 / (write + read)", ("reshard", "cases", "2->3", "ratio"), None, 2.0, "max"),
    ("reshard 4->2 / (write + read)", ("reshard", "cases", "4->2", "ratio"), None, 2.0, "max"),
    ("reshard rows 2->3 / (write + read)", ("reshard", "row_cases", "2->3", "ratio"), None, 2.0, "max"),
    ("reshard rows 4->2 / (write + read)", ("reshard", "row_cases", "4->2", "ratio"), None, 2.0, "max"),
]


def run_json(script: str, failures: list[dict], *args: str) -> dict:
    """The script's results; {} when it crashed twice (then it is in failures)."""
    def run() -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            started = time.monotonic()
            subprocess.run([sys.executable, str(HERE / script), *args, "--json", str(out)], check=True)
            print(f"{script}: {time.monotonic() - started:.0f} s", flush=True)
            return json.loads(out.read_text())
    return retried(script, run, failures) or {}


def median(results: dict, path: FigurePath) -> float | None:
    node = results
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node.get("median") if isinstance(node, dict) else None


def target_ratios(results: dict) -> list[dict]:
    """One row per target: the ratio (None when a figure is missing) and whether it is met."""
    rows = []
    for label, num, den, bound, kind in TARGETS:
        top, bottom = median(results, num), (median(results, den) if den else 1.0)
        ratio = None if top is None or not bottom else top / bottom
        met = None if bound is None or ratio is None else (ratio >= bound if kind == "min" else ratio <= bound)
        target = "none" if bound is None else f"{'>=' if kind == 'min' else '<='} {bound}"
        rows.append({"figure": label, "ratio": ratio, "target": target,
                     "met": None if bound is None else bool(met)})
    return rows


def summary(results: dict) -> list[str]:
    """The closing lines: every target ratio, then every run that failed (or that none did)."""
    lines = []
    for row in results["targets"]:
        ratio = "failed" if row["ratio"] is None else f"{row['ratio']:6.2f}"
        verdict = {True: "met", False: "MISSED", None: ""}[row["met"]]
        lines.append(f"{row['figure']:<42} {ratio:>6}  target {row['target']:<7} {verdict}".rstrip())
    scale = results.get("operator_scale") or {}
    for row in scale.get("targets", []):
        value = "failed" if row["value"] is None else f"{row['value']:6.2f}"
        verdict = {True: "met", False: "MISSED", None: ""}[row["met"]]
        lines.append(f"operator at {scale['config']['jobs']} jobs: {row['figure']:<26} {value:>6}  target "
                     f"{row['target']:<7} {verdict}".rstrip())
    check = (results.get("copies_check") or {}).get("summary")
    if check:
        lines.append(f"copies check: {check['ok']}/{check['runs']} runs ok ({len(check.get('not_checked', []))} could "
                     f"not be checked), {check['acknowledged']} pushes acknowledged, {check['lost']} lost, "
                     f"{check['duplicated']} applied twice, faults {check['faults']}")
    failures = results.get("failures", [])
    lines += [f"FAILED {f['run']}: exit code {f['exit_code']} after {f['attempts']} attempts ({f['reason']})"
              for f in failures]
    lines.append(f"{len(failures)} run(s) failed" if failures else "no run failed")
    return lines


def merge(ours: dict, peers: dict) -> dict:
    """The end-to-end groups of our jobs and of the peers side by side."""
    keys = ("examples_per_s", "time_to_accuracy_s", "time_to_accuracy_mnist_s")
    return {key: {**ours.get(key, {}), **peers.get(key, {})} for key in keys if key in ours or key in peers}


def per_replica(results: dict) -> dict:
    """The compute-bound job's examples/s per replica (the input speed's yardstick)."""
    rate, replicas = median(results, ("examples_per_s", "distbelief")), \
        results.get("efficiency", {}).get("compute_bound", {}).get("replicas")
    if rate is None or not replicas:
        return {}
    return {"compute_bound": summarize([rate / replicas])}


def measure(runs: int, scale: float, operator_jobs: int = 1000, operator_nodes: int = 100) -> dict:
    failures: list[dict] = []
    results = run_json("runtime_bench.py", failures, "--repeats", str(runs), "--params", "10000000")
    if mlp := run_json("mlp_step_bench.py", failures, "--runs", str(max(runs, 7))):
        results["mlp_step_ms"] = mlp
    ours = run_json("e2e_bench.py", failures, "--runs", str(runs), "--scale", str(scale))
    peers = run_json("torch_peers_bench.py", failures, "--what", "all", "--runs", str(runs))
    results.update(merge(ours, peers))
    # Ours, torch's and TensorFlow's in interleaved rounds, with each one's CPU per example.
    if rounds := run_json("peer_rounds.py", failures, "--rounds", str(min(runs, 3))):  # ~9 min a round
        results["peer_rounds"] = rounds["peer_rounds"]
        failures += rounds.get("failures", [])
    for key in ("efficiency", "efficiency_overlap", "efficiency_bfloat16", "accuracy_bfloat16",
                "final_accuracy_digits"):
        if key in ours:
            results[key] = ours[key]
    if sparse := run_json("sparse_bench.py", failures, "--runs", str(runs)):
        results["sparse"] = sparse["sparse"]
    if table := run_json("sparse_table_bench.py", failures):  # one run: minutes and ~5 GB
        results["sparse"] = {**results.get("sparse", {}), **table["sparse"]}
    if heavy := run_json("heavy_tail_bench.py", failures):  # one job per setting: ~2 min each
        results["heavy_tail"] = heavy["heavy_tail"]
    if sparse_peers := run_json("torchrec_peer.py", failures, "--rounds", str(min(runs, 3))):  # ~3 min a round
        results["sparse_peers"] = sparse_peers["sparse_peers"]
        failures += sparse_peers.get("failures", [])
    if backups := run_json("backups_bench.py", failures, "--runs", str(min(runs, 3))):
        results["backups"] = backups["backups"]
    if checked := run_json("copycheck.py", failures, "--runs", str(2 * runs), "--seconds", "30"):
        results["copies_check"] = checked["copies_check"]
    # Faults ignoring in-sync state: what each minInSync loses, and whether the shards say so.
    if unkind := run_json("copycheck.py", failures, "--unkind", "--seconds", "60"):
        results["copies_check_unkind"] = unkind["copies_check"]
    if window := run_json("takeover_window.py", failures, "--kills", str(max(runs, 5))):
        results["takeover_window"] = window["takeover_window"]
    if partitions := run_json("partition_bench.py", failures, "--runs", str(min(runs, 3))):
        results["partitions"] = partitions["partitions"]
        failures += partitions.get("failures", [])
    if staleness := run_json("staleness_bench.py", failures, "--runs", str(runs)):
        results["staleness_tau"] = staleness["staleness_tau"]
    if files := run_json("data_bench.py", failures, "--runs", str(runs)):
        results["data"] = files["data"]
    if relaid := run_json("reshard_bench.py", failures, "--runs", str(min(runs, 3))):
        results["reshard"] = relaid["reshard"]
    if fanout := run_json("fanout_bench.py", failures, "--runs", str(min(runs, 3))):
        results["fanout"] = fanout["fanout"]
    if dispenser := run_json("dispenser_scale.py", failures):
        results["dispenser_scale"] = dispenser["dispenser_scale"]
    if coordinator := run_json("sandblaster_scale.py", failures):
        results["sandblaster_scale"] = coordinator["sandblaster_scale"]
    if chief := run_json("chief_scale.py", failures):
        results["chief_scale"] = chief["chief_scale"]
    results["examples_per_replica_s"] = per_replica(results)
    operator = run_json("operator_bench.py", failures, "--runs", str(runs))
    if "operator_create_to_children_s" in operator:
        results["operator_create_to_children_s"] = operator["operator_create_to_children_s"]
    # One run (about 40 min at 1,000 jobs on 2 cores): issue 40's figures.
    if at_scale := run_json("operator_scale.py", failures, "--jobs", str(operator_jobs),
                            "--nodes", str(operator_nodes)):
        results["operator_scale"] = at_scale["operator_scale"]
    # Real nodes with shaped links (root and ../shared/kube; exit 2 without them: a failure).
    if shaped := run_json("shaped_scaling.py", failures, "--plot", str(HERE.parent / "docs" / "scale.png")):
        results["shaped_scaling"] = shaped["shaped_scaling"]
    results["peer_metadata"] = peers.get("metadata", {})
    results["failures"] = ours.get("failures", []) + peers.get("failures", []) + failures
    return results


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=str(HERE / "results.json"))
    p.add_argument("--plot", default=str(HERE.parent / "docs" / "benchmarks.png"))
    p.add_argument("--runs", type=int, default=5, help="runs per figure (at least 5 for the published figures)")
    p.add_argument("--scale", type=float, default=1.0, help="e2e_bench.py's --scale (1 for the published figures)")
    p.add_argument("--operator-jobs", type=int, default=1000, help="operator_scale.py's --jobs (1,000 for issue 40)")
    p.add_argument("--operator-nodes", type=int, default=100, help="operator_scale.py's --nodes")
    args = p.parse_args()
    results = measure(args.runs, args.scale, args.operator_jobs, args.operator_nodes)
    results["targets"] = target_ratios(results)
    path = Path(args.json)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(summary(results)))
    from plot_results import plot  # matplotlib only after the measurements
    plot(results, args.plot)
    print(f"wrote {path} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
