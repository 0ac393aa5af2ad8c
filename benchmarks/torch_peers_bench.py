#!/usr/bin/env python
"""PyTorch peers for the end-to-end benchmarks: the same models, data and optimizer as our
jobs, trained with torch.distributed on loopback, every process held to 1 thread.

    python benchmarks/torch_peers_bench.py [--what examples|accuracy|all] [--runs 5]
        [--steps 400] [--timeout 120] [--json out.json]

examples_per_s: a 784-512-512-10 ReLU MLP on synthetic:features=784,classes=10,samples=8192,seed=1,
batch 128 per replica, Adagrad lr 0.05, each replica drawing its own random minibatches.
  torch_ddp_gloo  2 ranks, DistributedDataParallel over gloo.
  torch_rpc_ps    torch.distributed.rpc (TensorPipe): 1 parameter server holding the flat
                  parameters and an Adagrad optimizer, 2 trainers that each step fetch the
                  parameters and push a gradient (Downpour with fetch/push every step).
After warm-up every replica times --steps steps, starting together at a barrier; the figure
is all replicas' examples / (last end - first start).

time_to_accuracy_s: torch_ddp_gloo (2 ranks, batch 32 each) training a 64-64-10 MLP on
builtin:digits (testFraction 0.2, Adagrad lr 0.05). The clock starts just before the processes
are launched and stops at rank 0's first held-out evaluation (full test set, every 0.25 s of
wall time) with accuracy >= 0.95; a run that has not got there by --timeout is a failure.
time_to_accuracy_mnist_s: the same, to 0.94, for a 784-256-128-10 MLP on the MNIST-sized set
of mnist_sized.py (10,000 held out, all scored), as e2e_bench.py times our job on it.

Every figure is the median, min and max over --runs runs, each in fresh processes (this
script with --child). Children bind and connect on 127.0.0.1 only, die with this process
(PR_SET_PDEATHSIG) and are killed if they overrun. A run that crashes (a rank exits
non-zero, gloo's SIGABRT for one) is retried once, then recorded under "failures" with
its exit code; the other runs go on.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "runtime")]

import numpy as np
import torch

from distbelief.runtime import jobspec
from distbelief.runtime.model import data

import mnist_sized
from figures import RunFailed, fmt, interleaved, save, summarize

SYNTHETIC = "synthetic:features=784,classes=10,samples=8192,seed=1"
LR = 0.05
BATCH = 128
WARMUP = 5
DIGITS_BATCH = 32
TARGET = 0.95
MNIST_TARGET = 0.94
EVAL_EVERY_S = 0.25  # as benchmarks/e2e_bench.py evaluates our jobs
STOP_CHECK_EVERY = 10  # steps between the ranks' all-reduce of rank 0's "target reached" flag
# Loopback for gloo and TensorPipe; TensorPipe limited to TCP so payloads cross loopback as
# ours do (its defaults would use shared memory / cross-memory attach on one host).
CHILD_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo",
             "MASTER_ADDR": "127.0.0.1"}


def mlp(sizes: tuple[int, ...]) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])  # no ReLU on the logits


def batches(dataset: data.Dataset, batch: int, seed: tuple[int, int]):
    """Our runtime's minibatch stream, as torch tensors (zero-copy)."""
    for x, y in data.minibatches(dataset, batch, np.random.default_rng(seed)):
        yield torch.from_numpy(x), torch.from_numpy(y)


def synthetic() -> data.Dataset:
    x, y = data.load_source(SYNTHETIC)
    return data.Dataset(x_train=x, y_train=y, x_test=x[:0], y_test=y[:0], n_classes=10)


# -- children: one process each ------------------------------------------------------

def init_gloo(c: dict) -> None:
    import torch.distributed as dist
    os.environ["MASTER_PORT"] = str(c["port"])
    dist.init_process_group("gloo", rank=c["rank"], world_size=2,
                            timeout=datetime.timedelta(seconds=c["timeout"]))


def timed(step, steps: int, barrier) -> dict:
    """WARMUP untimed steps, the replicas' barrier, then `steps` timed ones: this replica's report."""
    for _ in range(WARMUP):
        step()
    barrier()
    start = time.time()
    for _ in range(steps):
        step()
    return {"start": start, "end": time.time(), "examples": steps * BATCH}


def ddp_examples(c: dict) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    init_gloo(c)
    torch.manual_seed(c["run"])
    net = DistributedDataParallel(mlp((784, 512, 512, 10)))
    opt = torch.optim.Adagrad(net.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    stream = batches(synthetic(), BATCH, (c["run"], c["rank"]))

    def step() -> None:
        x, y = next(stream)
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()

    report = timed(step, c["steps"], dist.barrier)
    dist.destroy_process_group()
    return report


def ddp_accuracy(c: dict) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    init_gloo(c)
    ds = data.load(jobspec.Data(source=c["source"], test_fraction=c["test_fraction"]))
    torch.manual_seed(c["run"])
    model = mlp((ds.n_features, *c["hidden"], ds.n_classes))
    net = DistributedDataParallel(model)
    opt = torch.optim.Adagrad(net.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    x_test, y_test = torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test)
    stop = torch.zeros(1)
    reached, accuracy, steps = None, 0.0, 0
    next_eval = time.time() + EVAL_EVERY_S
    for x, y in batches(ds, c["batch"], (c["run"], c["rank"])):
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
        steps += 1
        now = time.time()
        if c["rank"] == 0 and reached is None and now >= next_eval:
            with torch.no_grad():  # the bare module: an evaluation is no DDP step
                accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
            next_eval = now + EVAL_EVERY_S
            if accuracy >= c["target"]:
                reached = time.time()
            if reached or now - c["t0"] > c["timeout"]:
                stop.fill_(1)
        if steps % STOP_CHECK_EVERY == 0:  # both ranks must leave DDP at the same step
            dist.all_reduce(stop)
            if stop.item():
                break
    dist.destroy_process_group()
    return {"reached": reached, "accuracy": accuracy, "steps": steps}


class ParameterServer:
    """Flat parameters and their Adagrad state; pushes apply one at a time."""

    def __init__(self, run: int) -> None:
        import threading
        torch.manual_seed(run)
        flat = torch.nn.utils.parameters_to_vector(mlp((784, 512, 512, 10)).parameters())
        self.params = torch.nn.Parameter(flat.detach())
        self.opt = torch.optim.Adagrad([self.params], lr=LR)
        self.lock = threading.Lock()
        self.start = threading.Barrier(2)


PS: ParameterServer | None = None  # set in the server process only


def ps_fetch() -> torch.Tensor:
    # Hogwild read: no lock, but a copy so the reply is not sent while a push writes it.
    return PS.params.detach().clone()


def ps_push(grad: torch.Tensor) -> None:
    with PS.lock:
        PS.params.grad = grad
        PS.opt.step()


def ps_barrier(timeout: float) -> None:
    PS.start.wait(timeout)


def rpc_ps(c: dict) -> dict | None:
    global PS
    from torch.distributed import rpc
    name = "ps" if c["rank"] == 0 else f"trainer{c['rank']}"
    if c["rank"] == 0:
        PS = ParameterServer(c["run"])  # before init_rpc: trainers may call at once
    opts = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{c['port']}", num_worker_threads=4,
        rpc_timeout=c["timeout"], _transports=["uv"], _channels=["basic"])
    rpc.init_rpc(name, rank=c["rank"], world_size=3, rpc_backend_options=opts)
    if c["rank"] == 0:
        rpc.shutdown()  # serves until both trainers have shut down
        return None
    net = mlp((784, 512, 512, 10))
    loss_fn = torch.nn.CrossEntropyLoss()
    stream = batches(synthetic(), BATCH, (c["run"], c["rank"]))

    def step() -> None:
        torch.nn.utils.vector_to_parameters(rpc.rpc_sync("ps", ps_fetch), net.parameters())
        x, y = next(stream)
        net.zero_grad()
        loss_fn(net(x), y).backward()
        grad = torch.nn.utils.parameters_to_vector(p.grad for p in net.parameters())
        rpc.rpc_sync("ps", ps_push, args=(grad,))

    report = timed(step, c["steps"], lambda: rpc.rpc_sync("ps", ps_barrier, args=(c["timeout"],)))
    rpc.shutdown()
    return report


CHILDREN = {"ddp_examples": ddp_examples, "ddp_accuracy": ddp_accuracy, "rpc_ps": rpc_ps}


def child_main(spec: str) -> int:
    torch.set_num_threads(1)
    # DDP's own set-up trips torch's deprecation warning about its internals, once per rank.
    warnings.filterwarnings("ignore", message="You are using a Backend")
    c = json.loads(spec)
    print(json.dumps(CHILDREN[c["job"]](c)), flush=True)
    return 0


# -- orchestration ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def launch(job: str, world: int, deadline: float, **spec) -> list[dict]:
    """Run `world` children of one job to completion; their JSON reports by rank."""
    spec = {"job": job, "port": free_port(), **spec}
    env = {**os.environ, **CHILD_ENV}
    procs = []
    try:
        for rank in range(world):
            cmd = [sys.executable, __file__, "--child", json.dumps({**spec, "rank": rank})]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True,
                                          preexec_fn=die_with_parent))
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.time()))
        if failed := [p.returncode for p in procs if p.returncode]:
            raise RunFailed(f"{job} (exit codes {[p.returncode for p in procs]})", failed[0])
        return [json.loads(p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()


def throughput(reports: list[dict]) -> float:
    reports = [r for r in reports if r]  # the parameter server reports nothing
    window = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    return sum(r["examples"] for r in reports) / window


def measure_examples(runs: int, steps: int, timeout: float, failures: list[dict]) -> dict:
    peers = {"torch_ddp_gloo": ("ddp_examples", 2), "torch_rpc_ps": ("rpc_ps", 3)}

    def measure(job: str, world: int, run: int) -> float:
        return throughput(launch(job, world, time.time() + timeout, run=run, steps=steps, timeout=timeout))
    out = interleaved(runs, {name: (lambda run, j=job, w=world: measure(j, w, run))
                             for name, (job, world) in peers.items()}, failures, "torch ")
    return {name: summarize(v) for name, v in out.items()}


DIGITS = {"source": "builtin:digits", "test_fraction": 0.2, "hidden": [64], "batch": DIGITS_BATCH,
          "target": TARGET}


def mnist_task() -> dict:
    return {"source": f"npz:{mnist_sized.make()}", "test_fraction": mnist_sized.TEST_FRACTION,
            "hidden": [256, 128], "batch": DIGITS_BATCH, "target": MNIST_TARGET}


def measure_accuracy(runs: int, timeout: float, task: dict, failures: list[dict]) -> dict:
    """Seconds to task's target accuracy with DDP gloo; a run that never gets there counts as missed."""
    steps: list[int] = []
    missed = 0

    def once(run: int) -> float | None:
        nonlocal missed
        t0 = time.time()
        rank0 = launch("ddp_accuracy", 2, t0 + timeout + 30, run=run, t0=t0, timeout=timeout, **task)[0]
        if rank0["reached"] is None:
            missed += 1
            print(f"time to {task['target']} on {task['source']}, run {run + 1}: not reached, accuracy "
                  f"{rank0['accuracy']:.3f} after {timeout:.0f} s", file=sys.stderr)
            return None
        steps.append(rank0["steps"])
        return rank0["reached"] - t0
    out = interleaved(runs, {"torch_ddp_gloo": once}, failures, f"torch time to {task['target']} ")
    return {"torch_ddp_gloo": {**summarize(out["torch_ddp_gloo"]), "steps": steps, "not_reached": missed}}


def metadata(args: argparse.Namespace) -> dict:
    return {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "threads_per_process": 1, "runs": args.runs, "steps": args.steps,
            "batch": BATCH, "digits_batch": DIGITS_BATCH, "target_accuracy": TARGET,
            "timeout_s": args.timeout, "rpc_transport": "tensorpipe uv (tcp), basic channel"}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=("examples", "accuracy", "all"), default="all")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=400, help="timed steps per replica (examples)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per run before giving up")
    p.add_argument("--json", default=None)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(args.child)
    out: dict = {}
    failures: list[dict] = []
    if args.what in ("examples", "all"):
        out["examples_per_s"] = measure_examples(args.runs, args.steps, args.timeout, failures)
        for name, s in out["examples_per_s"].items():
            print(f"examples_per_s     {name:<15} {fmt(s, '.0f')}")
    if args.what in ("accuracy", "all"):
        for key, task in (("time_to_accuracy_s", DIGITS), ("time_to_accuracy_mnist_s", mnist_task())):
            out[key] = measure_accuracy(args.runs, args.timeout, task, failures)
            s = out[key]["torch_ddp_gloo"]
            print(f"{key} torch_ddp_gloo  {fmt(s, '.2f')}  steps {s['steps']}  not reached {s['not_reached']}")
    out["metadata"] = metadata(args)
    save({**out, "failures": failures}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
