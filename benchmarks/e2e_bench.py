#!/usr/bin/env python
"""End to end: DistBeliefJobs run as a user runs them (`distbelief run`, local mode),
and the same model trained in one plain process, for the peers in torch_peers_bench.py.

    python benchmarks/e2e_bench.py [--what examples|accuracy|all] [--runs 5] [--json out.json]

examples_per_s.distbelief
    The 784-512-512-10 MLP on synthetic:features=784,classes=10,samples=8192,seed=1,
    batch 128, Adagrad lr 0.05, 2 shards and 2 replicas fetching and pushing every step.
    The rate is the examples shard 0 counted between its first evaluation after WARMUP_S
    and its last one, over the time between them (from the chief's history.jsonl), so
    process start-up and the final checkpoint are not in it: the same window the torch
    peers time.
examples_per_s.distbelief_unencrypted
    The same job with spec.parameterServers.encryption false (PLAIN join token, no
    CurveZMQ): what the cipher costs end to end. The peers encrypt nothing.
time_to_accuracy_s.{downpour, sandblaster, single_process}
    Seconds from launching the job (start-up included) to the first held-out evaluation
    at accuracy >= 0.95 on digits. downpour and sandblaster run examples/digits-mlp.yaml
    and examples/digits-sandblaster.yaml as shipped, with targetAccuracy 0.95 and an
    evaluation every EVAL_EVERY_S. single_process trains the downpour example's model
    (64 hidden, Adagrad lr 0.05, batch 32) in one process with no parameter server,
    evaluating at the same cadence.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "runtime")]

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from distbelief.runtime import contract, data, models, optim  # noqa: E402

from figures import fmt, save, summarize  # noqa: E402

DISTBELIEF = str(Path(sys.executable).with_name("distbelief"))
TARGET_ACCURACY = 0.95
EVAL_EVERY_S = 0.25
WARMUP_S = 2.0
JOB_TIMEOUT_S = 300.0
THROUGHPUT_STEPS = 1600  # pushes of 128 examples: ~10-15 s of training on 2 cores


def example(name: str) -> dict:
    return yaml.safe_load((REPO / "examples" / name).read_text())


def throughput_job(*, encrypted: bool) -> dict:
    job = example("digits-mlp.yaml")
    job["metadata"]["name"] = "throughput"
    spec = job["spec"]
    spec["model"] = {"type": "mlp", "hiddenLayers": [512, 512], "activation": "relu"}
    spec["data"] = {"source": "synthetic:features=784,classes=10,samples=8192,seed=1", "testFraction": 0.1,
                    "maxEvalExamples": 256}
    spec["training"].update({"batchSize": 128, "maxSteps": THROUGHPUT_STEPS, "evalEverySeconds": 1})
    spec["workers"]["replicas"] = 2
    spec["parameterServers"]["encryption"] = encrypted
    return job


def accuracy_job(name: str) -> dict:
    job = example(name)
    job["spec"]["training"].update({"targetAccuracy": TARGET_ACCURACY, "evalEverySeconds": EVAL_EVERY_S})
    return job


def run_job(job: dict) -> tuple[float, list[dict]]:
    """Run one job locally to its end; (launch time, the chief's evaluations)."""
    with tempfile.TemporaryDirectory() as tmp:
        manifest, output = Path(tmp) / "job.yaml", Path(tmp) / "out"
        manifest.write_text(yaml.safe_dump(job))
        launched = time.time()
        subprocess.run([DISTBELIEF, "--log-level", "warning", "run", str(manifest), "--output", str(output),
                        "--no-progress"], check=True, timeout=JOB_TIMEOUT_S,
                       stdout=subprocess.DEVNULL)
        [history] = output.glob(f"volumes/*-ps-0/{contract.CHECKPOINT_VOLUME}/{contract.HISTORY_FILE}")
        return launched, [json.loads(line) for line in history.read_text().splitlines()]


def steady_rate(history: list[dict]) -> float:
    """Examples/s between the first evaluation after WARMUP_S and the last one."""
    warm = [h for h in history if h["elapsed"] >= WARMUP_S]
    first, last = warm[0], warm[-1]
    return (last["examples"] - first["examples"]) / (last["time"] - first["time"])


def seconds_to_target(launched: float, history: list[dict]) -> float:
    hit = next(h for h in history if h["accuracy"] >= TARGET_ACCURACY)
    return hit["time"] - launched


def examples_per_s(runs: int) -> dict:
    rates: dict[str, list[float]] = {"distbelief": [], "distbelief_unencrypted": []}
    for _ in range(runs):  # interleaved, so drift in the machine's load hits both alike
        for name, encrypted in (("distbelief", True), ("distbelief_unencrypted", False)):
            rates[name].append(steady_rate(run_job(throughput_job(encrypted=encrypted))[1]))
    return {name: summarize(values) for name, values in rates.items()}


def time_to_accuracy(runs: int) -> dict:
    jobs = {"downpour": "digits-mlp.yaml", "sandblaster": "digits-sandblaster.yaml"}
    times: dict[str, list[float]] = {name: [] for name in [*jobs, "single_process"]}
    for _ in range(runs):  # interleaved, so drift in the machine's load hits all alike
        for name, manifest in jobs.items():
            times[name].append(seconds_to_target(*run_job(accuracy_job(manifest))))
        times["single_process"].append(single_process_seconds())
    return {name: summarize(values) for name, values in times.items()}


def single_process_seconds() -> float:
    launched = time.time()
    out = subprocess.run([sys.executable, __file__, "--single-process"], check=True, timeout=JOB_TIMEOUT_S,
                         capture_output=True, text=True).stdout
    return json.loads(out)["hit"] - launched


def train_single_process() -> None:
    """The downpour example's model and optimiser, in this process: prints when it hits the target."""
    spec = example("digits-mlp.yaml")["spec"]
    dataset = data.load(spec["data"])
    model = models.build_model(spec["model"], dataset.n_features, dataset.n_classes)
    params = model.init_params(0)
    grad = np.empty_like(params)
    adagrad = optim.Adagrad(params.size, spec["training"]["learningRate"])
    batches = data.minibatches(dataset, spec["training"]["batchSize"], np.random.default_rng(0))
    next_eval = time.time()
    while True:
        model.loss_and_grad(params, next(batches), out=grad)
        adagrad.apply(params, grad)
        if time.time() >= next_eval:
            if models.evaluate(model, params, dataset.x_test, dataset.y_test)[1] >= TARGET_ACCURACY:
                print(json.dumps({"hit": time.time()}))
                return
            next_eval = time.time() + EVAL_EVERY_S


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=["examples", "accuracy", "all"], default="all")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--single-process", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.single_process:
        train_single_process()
        return 0
    results: dict = {}
    if args.what in ("examples", "all"):
        results["examples_per_s"] = examples_per_s(args.runs)
    if args.what in ("accuracy", "all"):
        results["time_to_accuracy_s"] = time_to_accuracy(args.runs)
    for key, group in results.items():
        for name, s in group.items():
            print(f"{key}.{name:<24} {fmt(s)}")
    save(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
