#!/usr/bin/env python
"""End to end: DistBeliefJobs run as a user runs them (`distbelief run`, local mode),
each beside the same model trained in one plain process on one thread, for the peers in
torch_peers_bench.py.

    python benchmarks/e2e_bench.py [--what examples|efficiency|accuracy|all] [--runs 5]
        [--scale 1.0] [--json out.json]

Every job runs 2 shards and 2 replicas (4 processes and the chief on this machine's cores)
and every process holds its BLAS to 1 thread (the pods' CPU requests are below one core).

examples_per_s.{distbelief, distbelief_unencrypted}, efficiency.compute_bound  (--what examples)
    The 784-512-512-10 MLP on synthetic:features=784,classes=10,samples=8192,seed=1,
    batch 128, Adagrad lr 0.05, fetching and pushing every step. The rate is the examples
    shard 0 counted between its first evaluation after the workload's warm-up and its last
    one, over the time between them (from the chief's history.jsonl), so process start-up
    and the final checkpoint are not in it: the same window the torch peers time.
    distbelief_unencrypted is the same job with spec.parameterServers.encryption false
    (PLAIN join token, no CurveZMQ): what the cipher costs end to end.
efficiency.{compute_bound, communication_bound, large_dense}  (--what examples, efficiency)
    Parallel efficiency: the job's examples/s / (cores x the examples/s of one plain process
    on one thread training the job's model, batch and optimizer). Each run pairs a job with
    a baseline measured right after it; the figure is over those pairs.
      compute_bound        784-512-512-10, batch 128, fetchEvery = pushEvery = 1
      communication_bound  784-256-128-10, batch 32,  fetchEvery = pushEvery = 2
      large_dense          1000-10000-8000-10 (90.1M parameters), batch 32, every step
efficiency_overlap.compute_bound, examples_per_s.distbelief_overlap  (--what examples)
    The compute-bound job with spec.training.overlap, run between the others and divided
    by the same baselines.
efficiency_bfloat16.{communication_bound, large_dense}  (--what efficiency)
    The same two jobs with spec.parameterServers.wireFormat bfloat16, run between the
    float32 ones and divided by the same baselines.
time_to_accuracy_s.{downpour, downpour_overlap, sandblaster, single_process}  (--what accuracy)
    Seconds from launching the job (start-up included) to the first held-out evaluation
    at accuracy >= 0.95 on digits. downpour and sandblaster run examples/digits-mlp.yaml
    and examples/digits-sandblaster.yaml as shipped, with targetAccuracy 0.95 and an
    evaluation every EVAL_EVERY_S. single_process trains the downpour example's model
    (64 hidden, Adagrad lr 0.05, batch 32) in one process with no parameter server,
    evaluating at the same cadence. downpour_overlap: the downpour example with
    spec.training.overlap.
final_accuracy_digits.{downpour, downpour_overlap}  (--what accuracy)
    The held-out accuracy of the digits example as shipped (its maxSteps, no target) at its
    last evaluation, without and with spec.training.overlap.
time_to_accuracy_mnist_s.{distbelief, single_process}  (--what accuracy)
    The same clock to 0.94 held-out accuracy on the MNIST-sized set of mnist_sized.py
    (70,000 28x28 images, 10,000 held out, all scored), with the communication-bound
    job's model and settings.
accuracy_bfloat16.{float32, bfloat16, difference}  (--what accuracy)
    The held-out accuracy (all 10,000 held-out images) of that MNIST-sized job after a fixed
    WIRE_ACCURACY_STEPS updates, with each wire format, run in turns; difference is
    bfloat16 - float32, run by run.

A run that crashes is retried once, then recorded under "failures" with its exit code;
the other runs and figures go on.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "runtime")]

import numpy as np
import yaml

from distbelief.runtime import contract, jobresolve
from distbelief.runtime.model import data, models
from distbelief.runtime.params import optim

import mnist_sized
from figures import RunFailed, available_cores, fmt, interleaved, save, summarize

DISTBELIEF = str(Path(sys.executable).with_name("distbelief"))
TARGET_ACCURACY = 0.95
MNIST_TARGET = 0.94
EVAL_EVERY_S = 0.25
WIRE_ACCURACY_STEPS = 4000
JOB_TIMEOUT_S = 600.0
SHARDS, REPLICAS = 2, 2
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SYNTHETIC_784 = "synthetic:features=784,classes=10,samples=8192,seed=1"


@dataclasses.dataclass(frozen=True)
class Workload:
    """A job of the efficiency figures; its one-process baseline trains the same spec."""
    hidden: tuple[int, ...]
    source: str
    batch: int
    every: int  # fetchEvery = pushEvery
    steps: int  # the job's maxSteps (global updates)
    warmup_s: float  # history before this is start-up, left out of the rate
    eval_every_s: float = 1.0
    baseline_s: float = 5.0  # timed seconds of the one-process baseline
    memory: str = "1Gi"
    max_runs: int = 5  # runs of this workload at most, whatever --runs says


WORKLOADS = {
    "compute_bound": Workload((512, 512), SYNTHETIC_784, 128, 1, steps=1600, warmup_s=2.0),
    "communication_bound": Workload((256, 128), SYNTHETIC_784, 32, 2, steps=4000, warmup_s=2.0),
    "large_dense": Workload((10000, 8000), "synthetic:features=1000,classes=10,samples=2048,seed=1", 32, 1,
                            steps=40, warmup_s=15.0, eval_every_s=10.0, baseline_s=20.0, memory="4Gi", max_runs=3),
}


def example(name: str) -> dict:
    return yaml.safe_load((REPO / "examples" / name).read_text())


def workload_job(name: str, w: Workload, *, scale: float = 1.0, encrypted: bool = True,
                 wire_format: str = "float32", overlap: bool = False) -> dict:
    """The DistBeliefJob of a workload: the digits example with the workload's model, data and settings."""
    job = example("digits-mlp.yaml")
    job["metadata"]["name"] = name.replace("_", "-")
    spec = job["spec"]
    spec["model"] = {"type": "mlp", "hiddenLayers": list(w.hidden), "activation": "relu"}
    spec["data"] = {"source": w.source, "testFraction": 0.1, "maxEvalExamples": 256}
    spec["training"].update({"batchSize": w.batch, "fetchEvery": w.every, "pushEvery": w.every,
                             "maxSteps": max(1, round(w.steps * scale)), "evalEverySeconds": w.eval_every_s})
    spec["parameterServers"]["shards"], spec["workers"]["replicas"] = SHARDS, REPLICAS
    spec["parameterServers"]["encryption"] = encrypted
    spec["parameterServers"]["wireFormat"] = wire_format
    spec["training"]["overlap"] = overlap
    for role in (spec["parameterServers"], spec["workers"]):
        role["resources"]["limits"]["memory"] = w.memory
    return job


def mnist_job() -> dict:
    """The communication-bound job on the MNIST-sized set, until 0.94 held-out accuracy."""
    job = workload_job("mnist", WORKLOADS["communication_bound"])
    spec = job["spec"]
    spec["data"] = {"source": f"npz:{mnist_sized.make()}", "testFraction": mnist_sized.TEST_FRACTION,
                    "maxEvalExamples": mnist_sized.HELD_OUT}
    spec["training"].update({"targetAccuracy": MNIST_TARGET, "evalEverySeconds": EVAL_EVERY_S,
                             "maxSteps": 1_000_000})
    return job


def wire_accuracy_job(wire_format: str) -> dict:
    """The MNIST-sized job for a fixed WIRE_ACCURACY_STEPS updates, in one wire format."""
    job = mnist_job()
    training = job["spec"]["training"]
    del training["targetAccuracy"]
    training.update({"maxSteps": WIRE_ACCURACY_STEPS, "evalEverySeconds": 5.0})  # the final evaluation counts
    job["spec"]["parameterServers"]["wireFormat"] = wire_format
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


def steady_window(history: list[dict], warmup_s: float = 2.0) -> tuple[dict, dict]:
    """The first evaluation after warmup_s and the last one: the window a job's rate is timed over."""
    warm = [h for h in history if h["elapsed"] >= warmup_s]
    if len(warm) < 2:
        raise RunFailed(f"{len(warm)} evaluation(s) after {warmup_s} s of warm-up: no rate", None)
    return warm[0], warm[-1]


def steady_rate(history: list[dict], warmup_s: float = 2.0) -> float:
    """Examples/s between the first evaluation after warmup_s and the last one."""
    first, last = steady_window(history, warmup_s)
    return (last["examples"] - first["examples"]) / (last["time"] - first["time"])


def seconds_to_target(launched: float, history: list[dict], target: float = TARGET_ACCURACY) -> float:
    hit = next((h for h in history if h["accuracy"] >= target), None)
    if hit is None:
        raise RunFailed(f"the job ended without reaching accuracy {target}", None)
    return hit["time"] - launched


def efficiency(job_rate: float, single_rate: float, cores: int) -> float:
    """Parallel efficiency: examples/s per core of the job over those of one plain process."""
    return job_rate / (cores * single_rate)


def paired_efficiency(job: list[float | None], single: list[float | None], cores: int) -> list[float]:
    """The efficiency of every run whose job and baseline both produced a rate."""
    return [efficiency(j, s, cores) for j, s in zip(job, single) if j is not None and s is not None]


def job_rate(job: dict, warmup_s: float) -> Callable[[int], float]:
    return lambda run: steady_rate(run_job(job)[1], warmup_s)


def efficiency_figure(job: list, single: list, cores: int, w: Workload) -> dict:
    return {**summarize(paired_efficiency(job, single, cores)), "cores": cores, "shards": SHARDS,
            "replicas": REPLICAS, "batch": w.batch, "fetch_push_every": w.every,
            "model": [*w.hidden], "examples_per_s": summarize(job),
            "single_process_examples_per_s": summarize(single)}


def measure_workload(name: str, runs: int, scale: float, cores: int, failures: list[dict],
                     variants: dict[str, Callable[[int], float]] | None = None) -> tuple[dict, dict[str, list]]:
    """A workload's job, any variants of it, and its one-process baseline, interleaved:
    (its efficiency figure, every measure's rates by name)."""
    w = WORKLOADS[name]
    job = workload_job(name, w, scale=scale)
    baseline = f"{name}_single_process"
    values = interleaved(min(runs, w.max_runs), {
        name: job_rate(job, w.warmup_s), **(variants or {}),
        baseline: lambda run: baseline_rate(job["spec"], w.baseline_s * scale),
    }, failures, "e2e ")
    return efficiency_figure(values[name], values[baseline], cores, w), values


def measure_examples(runs: int, scale: float, cores: int, failures: list[dict]) -> dict:
    """examples_per_s (encrypted and not, overlapped or not) and efficiency.compute_bound
    (and efficiency_overlap's), from the same runs and baselines."""
    w = WORKLOADS["compute_bound"]
    unencrypted = job_rate(workload_job("compute_bound", w, scale=scale, encrypted=False), w.warmup_s)
    overlapped = job_rate(workload_job("compute_bound", w, scale=scale, overlap=True), w.warmup_s)
    figure, values = measure_workload("compute_bound", runs, scale, cores, failures,
                                      {"compute_bound_unencrypted": unencrypted, "compute_bound_overlap": overlapped})
    return {"examples_per_s": {"distbelief": summarize(values["compute_bound"]),
                               "distbelief_unencrypted": summarize(values["compute_bound_unencrypted"]),
                               "distbelief_overlap": summarize(values["compute_bound_overlap"])},
            "efficiency": {"compute_bound": figure},
            "efficiency_overlap": {"compute_bound": efficiency_figure(
                values["compute_bound_overlap"], values["compute_bound_single_process"], cores, w)}}


def measure_efficiency(runs: int, scale: float, cores: int, failures: list[dict]) -> dict:
    """efficiency.{communication_bound, large_dense}, and efficiency_bfloat16 of the same jobs
    with a bfloat16 wire, from the same runs and baselines."""
    float32, bfloat16 = {}, {}
    for name in ("communication_bound", "large_dense"):
        w, variant = WORKLOADS[name], f"{name}_bfloat16"
        narrow = job_rate(workload_job(name, w, scale=scale, wire_format="bfloat16"), w.warmup_s)
        float32[name], values = measure_workload(name, runs, scale, cores, failures, {variant: narrow})
        bfloat16[name] = efficiency_figure(values[variant], values[f"{name}_single_process"], cores, w)
    return {"efficiency": float32, "efficiency_bfloat16": bfloat16}


def overlapped(job: dict) -> dict:
    job = json.loads(json.dumps(job))
    job["spec"]["training"]["overlap"] = True
    return job


def final_accuracy(job: dict) -> float:
    return run_job(job)[1][-1]["accuracy"]


def measure_accuracy(runs: int, failures: list[dict]) -> dict:
    downpour, sandblaster = accuracy_job("digits-mlp.yaml"), accuracy_job("digits-sandblaster.yaml")
    digits_values = interleaved(runs, {
        "downpour": lambda run: seconds_to_target(*run_job(downpour)),
        "downpour_overlap": lambda run: seconds_to_target(*run_job(overlapped(downpour))),
        "sandblaster": lambda run: seconds_to_target(*run_job(sandblaster)),
        "single_process": lambda run: single_process_seconds(example("digits-mlp.yaml")["spec"], TARGET_ACCURACY),
    }, failures, "e2e ")
    job = mnist_job()
    mnist_values = interleaved(runs, {
        "distbelief": lambda run: seconds_to_target(*run_job(job), MNIST_TARGET),
        "single_process": lambda run: single_process_seconds(job["spec"], MNIST_TARGET),
    }, failures, "e2e ")
    shipped = example("digits-mlp.yaml")
    final = interleaved(runs, {"downpour": lambda run: final_accuracy(shipped),
                               "downpour_overlap": lambda run: final_accuracy(overlapped(shipped))}, failures, "e2e ")
    return {"time_to_accuracy_s": {name: summarize(v) for name, v in digits_values.items()},
            "time_to_accuracy_mnist_s": {name: summarize(v) for name, v in mnist_values.items()},
            "final_accuracy_digits": {name: summarize(v) for name, v in final.items()}}


def measure_wire_accuracy(runs: int, failures: list[dict]) -> dict:
    """accuracy_bfloat16: the MNIST-sized job's final held-out accuracy with each wire format."""
    jobs = {fmt: wire_accuracy_job(fmt) for fmt in ("float32", "bfloat16")}
    values = interleaved(runs, {fmt: (lambda run, job=job: run_job(job)[1][-1]["accuracy"])
                                for fmt, job in jobs.items()}, failures, "e2e accuracy ")
    differences = [b - f for f, b in zip(values["float32"], values["bfloat16"]) if f is not None and b is not None]
    return {"accuracy_bfloat16": {**{fmt: summarize(v) for fmt, v in values.items()},
                                  "difference": summarize(differences)}}


# -- one plain process on one thread --------------------------------------------------

def plain_child(task: dict, timeout: float = JOB_TIMEOUT_S) -> dict:
    """Run this script's one-process trainer on one thread; what it reports."""
    out = subprocess.run([sys.executable, __file__, "--single-process", json.dumps(task)], check=True,
                         timeout=timeout, capture_output=True, text=True, env={**os.environ, **ONE_THREAD}).stdout
    return json.loads(out)


def baseline_rate(spec: dict, seconds: float) -> float:
    return plain_child({"spec": spec, "seconds": seconds})["examples_per_s"]


def single_process_seconds(spec: dict, target: float) -> float:
    launched = time.time()
    return plain_child({"spec": spec, "target": target})["hit"] - launched


def plain_trainer(spec: dict) -> tuple[Callable[[], None], Callable[[], float]]:
    """A job's model, data and optimizer in this process, no parameter server:
    (one training step, held-out accuracy now)."""
    typed = jobresolve.resolve(spec)
    dataset = data.load(typed.data)
    model = models.build_model(typed.model, dataset.n_features, dataset.n_classes)
    params = model.init_params(0)
    grad = np.empty_like(params)
    adagrad = optim.Adagrad(params.size, typed.training.learning_rate)
    batches = data.minibatches(dataset, typed.training.batch_size, np.random.default_rng(0))
    limit = typed.data.max_eval_examples
    x_test, y_test = dataset.x_test[:limit], dataset.y_test[:limit]

    def step() -> None:
        model.loss_and_grad(params, next(batches), out=grad)
        adagrad.apply(params, grad)
    return step, lambda: models.evaluate(model, params, x_test, y_test)[1]


def train_for(step: Callable[[], None], batch: int, seconds: float) -> dict:
    """Examples/s over `seconds` of steps (at least 3), after 2 untimed warm-up steps, and the
    timed window's wall-clock ends."""
    step(), step()
    start, started, steps = time.time(), time.perf_counter(), 0
    while steps < 3 or time.perf_counter() - started < seconds:
        step()
        steps += 1
    return {"examples_per_s": steps * batch / (time.perf_counter() - started), "examples": steps * batch,
            "start": start, "end": time.time()}


def train_to(step: Callable[[], None], accuracy: Callable[[], float], target: float) -> dict:
    """Train until held-out accuracy reaches target, evaluating every EVAL_EVERY_S; when it did."""
    next_eval = time.time()
    while True:
        step()
        if time.time() >= next_eval:
            if accuracy() >= target:
                return {"hit": time.time()}
            next_eval = time.time() + EVAL_EVERY_S


def single_process_main(task: dict) -> None:
    step, accuracy = plain_trainer(task["spec"])
    if "target" in task:
        report = train_to(step, accuracy, task["target"])
    else:
        report = train_for(step, task["spec"]["training"]["batchSize"], task["seconds"])
    print(json.dumps(report))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=["examples", "efficiency", "accuracy", "all"], default="all")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--scale", type=float, default=1.0,
                   help="times the jobs' steps and the baselines' seconds (below 1 for quick trials only)")
    p.add_argument("--json", default=None)
    p.add_argument("--single-process", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.single_process:
        single_process_main(json.loads(args.single_process))
        return 0
    cores, failures = available_cores(), []
    results: dict = {}
    if args.what in ("examples", "all"):
        results.update(measure_examples(args.runs, args.scale, cores, failures))
    if args.what in ("efficiency", "all"):
        efficiency_part = measure_efficiency(args.runs, args.scale, cores, failures)
        results["efficiency"] = {**results.get("efficiency", {}), **efficiency_part["efficiency"]}
        results["efficiency_bfloat16"] = efficiency_part["efficiency_bfloat16"]
    if args.what in ("accuracy", "all"):
        results.update(measure_accuracy(args.runs, failures))
        results.update(measure_wire_accuracy(args.runs, failures))
    report(results)
    save({**results, "failures": failures}, args.json)
    return 0


def report(results: dict) -> None:
    for key, group in results.items():
        for name, s in group.items():
            print(f"{key}.{name:<24} {fmt(s, '.4f' if key == 'accuracy_bfloat16' else '.2f')}")


if __name__ == "__main__":
    sys.exit(main())
