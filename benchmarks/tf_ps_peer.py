#!/usr/bin/env python
"""TensorFlow's ParameterServerStrategy, the maintained descendant of DistBelief, on the
compute-bound model of e2e_bench.py: the peer a user of Kubeflow's TFJob would pick.

    python benchmarks/tf_ps_peer.py [--dispatch 1] [--steps 400] [--run 0] [--json out.json]

The cluster is 2 parameter-server tasks and 2 workers (tf.distribute.Server, one process
each, gRPC on 127.0.0.1) and the coordinator in a process of its own, as TFJob lays it out.
The model is the 784-512-512-10 ReLU MLP on synthetic:features=784,classes=10,samples=8192,
seed=1, batch 128 per step, Adagrad lr 0.05. Every weight and bias is split in two halves
along its first axis, one on each parameter-server task (the layout of our 2 shards), and
Adagrad runs there: each step's gradient is sent to the tasks holding the variables, which
apply it (ResourceApplyAdagradV2 is placed with its variable). Every step reads every
variable afresh, so each is Downpour with fetchEvery = pushEvery = 1.

--dispatch is the steps a worker runs per function the coordinator schedules (steps per
dispatch, TF's steps_per_execution): at 1 the coordinator's Python and RPC cost is paid per
step, at 8 it is paid once per 8 steps, while each step still reads every variable and
updates them on the parameter servers. The figure is examples/s over --steps timed steps of
both workers together, after warm-up, with every process held to 1 intra-op thread.

The report (stdout, or --json) has examples_per_s and the timed window's wall-clock start
and end (time.time()), so a caller can meter the CPU of the processes in that window.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "runtime")]

SYNTHETIC = "synthetic:features=784,classes=10,samples=8192,seed=1"
SIZES = (784, 512, 512, 10)
BATCH, LR, WARMUP_DISPATCHES = 128, 0.05, 4
PS_TASKS, WORKERS = 2, 2
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def cluster_spec(ports: list[int]) -> dict[str, list[str]]:
    addresses = [f"127.0.0.1:{p}" for p in ports]
    return {"ps": addresses[:PS_TASKS], "worker": addresses[PS_TASKS:PS_TASKS + WORKERS],
            "chief": addresses[PS_TASKS + WORKERS:]}


def session_config():
    import tensorflow as tf
    return tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)


def serve(spec: dict, job: str, index: int) -> None:
    """A parameter-server or worker task: serves until killed."""
    import tensorflow as tf
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job, task_index=index,
                                  protocol="grpc", config=session_config(), start=True)
    server.join()


def halves(strategy, shape: tuple[int, ...], seed: int) -> list:
    """One variable's two halves along axis 0, created in turn so that the strategy's
    round-robin placement puts one on each parameter-server task."""
    import tensorflow as tf
    rng = tf.random.Generator.from_seed(seed)
    scale = (2.0 / shape[0]) ** 0.5 if len(shape) == 2 else 0.0
    full = rng.normal(shape) * scale
    parts = tf.split(full, 2, axis=0)
    with strategy.scope():
        return [tf.Variable(p) for p in parts]


def model(strategy) -> tuple[list, list]:
    """(variables, their Adagrad accumulators, each beside its variable)."""
    import tensorflow as tf
    variables = []
    for layer, (fan_in, fan_out) in enumerate(zip(SIZES, SIZES[1:])):
        variables += halves(strategy, (fan_in, fan_out), 2 * layer)
        variables += halves(strategy, (fan_out,), 2 * layer + 1)
    accumulators = []
    with strategy.scope():
        for v in variables:
            with strategy.extended.colocate_vars_with(v):
                accumulators.append(tf.Variable(tf.fill(v.shape, 0.1)))
    return variables, accumulators


def forward(variables: list, x):
    import tensorflow as tf
    h = x
    for layer in range(len(SIZES) - 1):
        w = tf.concat(variables[4 * layer:4 * layer + 2], 0)
        b = tf.concat(variables[4 * layer + 2:4 * layer + 4], 0)
        h = tf.matmul(h, w) + b
        if layer < len(SIZES) - 2:
            h = tf.nn.relu(h)
    return h


def coordinate(spec: dict, dispatch: int, steps: int, run: int) -> dict:
    """The coordinator: build the model on the parameter servers, schedule training functions
    of `dispatch` steps on the workers, time `steps` steps of both after warm-up."""
    import numpy as np
    import tensorflow as tf
    from distbelief.runtime.model import data
    tf.config.threading.set_intra_op_parallelism_threads(1)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    variables, accumulators = model(strategy)
    x, y = data.load_source(SYNTHETIC)

    def dataset_fn():
        ds = tf.data.Dataset.from_tensor_slices((x.astype(np.float32), y.astype(np.int64)))
        return ds.shuffle(len(x), seed=run).repeat().batch(BATCH, drop_remainder=True).prefetch(2)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(batch) -> None:
        features, labels = batch
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, forward(variables, features)))
        for v, a, g in zip(variables, accumulators, tape.gradient(loss, variables)):
            tf.raw_ops.ResourceApplyAdagradV2(var=v.handle, accum=a.handle, lr=LR, epsilon=1e-7, grad=g)

    @tf.function
    def train(iterator) -> None:
        for _ in tf.range(dispatch):
            strategy.run(step, args=(next(iterator),))

    for _ in range(WARMUP_DISPATCHES * WORKERS):
        coordinator.schedule(train, args=(iterator,))
    coordinator.join()
    dispatches = max(WORKERS, -(-steps // dispatch))
    start = time.time()
    for _ in range(dispatches):
        coordinator.schedule(train, args=(iterator,))
    coordinator.join()
    end = time.time()
    examples = dispatches * dispatch * BATCH
    return {"examples_per_s": examples / (end - start), "examples": examples, "start": start, "end": end,
            "dispatch": dispatch}


def die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def child(role: str, spec: dict, index: int, extra: dict) -> subprocess.Popen:
    task = json.dumps({"role": role, "spec": spec, "index": index, **extra})
    return subprocess.Popen([sys.executable, __file__, "--child", task], env={**os.environ, **ONE_THREAD},
                            stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)


def run_cluster(dispatch: int, steps: int, run: int, timeout: float) -> dict:
    """Start the tasks and the coordinator, wait for the coordinator's report, stop the tasks."""
    spec = cluster_spec(free_ports(PS_TASKS + WORKERS + 1))
    tasks = [child("ps", spec, i, {}) for i in range(PS_TASKS)] + [child("worker", spec, i, {})
                                                                   for i in range(WORKERS)]
    chief = child("chief", spec, 0, {"dispatch": dispatch, "steps": steps, "run": run})
    tasks.append(chief)  # stopped with the others, should it overrun
    try:
        out, _ = chief.communicate(timeout=timeout)
        if chief.returncode:
            raise subprocess.CalledProcessError(chief.returncode, "tf_ps_peer coordinator")
        return json.loads(out)
    finally:
        for p in tasks:
            p.kill()
            p.wait()
            p.stdout.close()


def child_main(task: dict) -> int:
    if task["role"] == "chief":
        print(json.dumps(coordinate(task["spec"], task["dispatch"], task["steps"], task["run"])), flush=True)
    else:
        serve(task["spec"], task["role"], task["index"])
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dispatch", type=int, default=1, help="steps per scheduled function")
    p.add_argument("--steps", type=int, default=400, help="timed steps of both workers together")
    p.add_argument("--run", type=int, default=0, help="the run's index (the data order's seed)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", default=None)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(json.loads(args.child))
    report = run_cluster(args.dispatch, args.steps, args.run, args.timeout)
    print(f"TF ParameterServerStrategy, {args.dispatch} step(s) per dispatch: {report['examples_per_s']:.0f} examples/s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
