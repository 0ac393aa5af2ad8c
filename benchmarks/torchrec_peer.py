#!/usr/bin/env python
"""TorchRec, what users pick for embedding tables, on heavy_tail_bench.py's click data:
the peer of our sparse jobs.

    python benchmarks/torchrec_peer.py [--rounds 3] [--json out.json]
    python benchmarks/torchrec_peer.py --seconds 80     (TorchRec alone, for that long)

The data, split and held-out examples are those of heavy_tail_bench.py's larger job
(4x2-defaults: 12 fields of Zipf(1.15) ids over 10M, 240,000 training examples, AUC on the
first 10,000 held-out ones). The model is the same wide and deep one: per field an
8-value embedding and a per-class wide weight, the embeddings concatenated into an MLP
[32] whose 2 logits the wide weights are added to, batch 256 per rank, learning rate 0.05.

TorchRec shards it over 2 gloo ranks on CPU: its tables need a fixed row count, so each
field's ids are hashed into HASH_ROWS rows (about 47,000 distinct ids per field: few
collisions), and its tables are sharded table-wise (row-wise sharding is CUDA-only). The
tables learn with fbgemm's fused Adagrad (torch.optim.Adagrad given to
apply_optimizer_in_backward becomes EXACT_ADAGRAD: an accumulator per value, as ours keeps),
the MLP with Adagrad through DDP. No L2 on the rows and nothing like our embedAfter.

Each round runs our job (heavy_tail_bench.py's 4x2-defaults: 4 shards, 2 replicas, the
spec's defaults) in local mode, then TorchRec for as many seconds as our job took from
launch to its end (start-up included on our side, not on TorchRec's: TorchRec's clock
starts after its planner, sharding and warm-up steps, and stops for its evaluations).
Rank 0 evaluates the held-out AUC every EVAL_EVERY_S. The figures are examples/s and the
final and best held-out AUC of each, and per round ours over TorchRec's examples/s and
ours minus TorchRec's AUC: the median of the rounds with min and max.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "runtime"), str(HERE)]

import numpy as np

import heavy_tail_bench
from figures import RunFailed, fmt, retried, save, summarize
from torch_peers_bench import die_with_parent, free_port

HASH_ROWS = 1 << 20
DIM, HIDDEN, BATCH, LR, CLASSES = 8, 32, 256, 0.05, 2
ROW = 12  # DIM + CLASSES, rounded up to fbgemm's multiple of 4
RANKS, WARMUP_STEPS = 2, 5
EVAL_EVERY_S = 10.0
CHECK_EVERY = 20  # steps between the ranks' agreement on stopping and evaluating


def click_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(training ids, labels, held-out ids, labels): the 4x2 job's split and held-out examples."""
    from distbelief.runtime import jobresolve
    from distbelief.runtime.model import data
    name, _, embeddings, rest = next(s for s in heavy_tail_bench.SETTINGS if s[0] == "4x2-defaults")
    spec = jobresolve.resolve(heavy_tail_bench.job_doc(name, embeddings, rest)["spec"])
    dataset = data.load(spec.data)
    limit = spec.data.max_eval_examples
    return dataset.ids_train, dataset.y_train, dataset.ids_test[:limit], dataset.y_test[:limit]


def hashed(ids: np.ndarray) -> np.ndarray:
    """Each field's ids in 0..HASH_ROWS-1 (a multiplicative hash), -1 kept for missing."""
    rows = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - 20)
    return np.where(ids < 0, -1, rows.astype(np.int64))


def features(ids: np.ndarray, fields: int):
    """One KeyedJaggedTensor of a batch: per field, each example's one id (none when missing)."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    present = ids.T >= 0  # field-major, as the jagged layout is
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{f}" for f in range(fields)], values=torch.from_numpy(np.ascontiguousarray(ids.T[present])),
        lengths=torch.from_numpy(present.astype(np.int32).ravel()))


def build(fields: int):
    """Per field one table whose rows hold the embedding then the wide weights, as our rows
    do (ROW values: fbgemm wants a multiple of 4, so 2 are unused)."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    class WideAndDeep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tables = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name=f"t{f}", embedding_dim=ROW, num_embeddings=HASH_ROWS, feature_names=[f"f{f}"])
                for f in range(fields)], device=torch.device("meta"))
            self.mlp = torch.nn.Sequential(torch.nn.Linear(fields * DIM, HIDDEN), torch.nn.ReLU(),
                                           torch.nn.Linear(HIDDEN, CLASSES))

        def forward(self, kjt):
            rows = torch.stack(list(self.tables(kjt).to_dict().values()), dim=1)  # [batch, fields, ROW]
            deep, wide = rows[:, :, :DIM].flatten(1), rows[:, :, DIM:DIM + CLASSES].sum(1)
            return self.mlp(deep) + wide
    return WideAndDeep()


def sharded(module, pg):
    import torch
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    apply_optimizer_in_backward(torch.optim.Adagrad, module.tables.parameters(), {"lr": LR})
    constraints = {t.name: ParameterConstraints(sharding_types=["table_wise"])
                   for t in module.tables.embedding_bag_configs()}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=RANKS, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(module, pg=pg)
    return DistributedModelParallel(module, device=torch.device("cpu"), plan=plan,
                                    env=ShardingEnv.from_process_group(pg))


def auc(model, ids: np.ndarray, labels: np.ndarray) -> float:
    import torch
    from sklearn.metrics import roc_auc_score
    scores = []
    with torch.no_grad():
        for start in range(0, len(ids), 2048):
            logits = model(features(ids[start:start + 2048], ids.shape[1]))
            scores.append((logits[:, 1] - logits[:, 0]).numpy())
    return float(roc_auc_score(labels, np.concatenate(scores)))


def rank_main(c: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    torch.set_num_threads(1)
    os.environ["MASTER_PORT"] = str(c["port"])
    dist.init_process_group("gloo", rank=c["rank"], world_size=RANKS, timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(c["run"])
    train_ids, train_y, test_ids, test_y = click_data()
    train_ids, test_ids = hashed(train_ids), hashed(test_ids)
    model = sharded(build(train_ids.shape[1]), dist.GroupMember.WORLD)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda p: torch.optim.Adagrad(p, lr=LR))
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    rng = np.random.default_rng([c["run"], c["rank"]])
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        rows = rng.integers(0, len(train_y), BATCH)
        optimizer.zero_grad()
        loss_fn(model(features(train_ids[rows], train_ids.shape[1])), torch.from_numpy(train_y[rows])).backward()
        optimizer.step()

    for _ in range(WARMUP_STEPS):
        step()
    return train_for(step, model, test_ids, test_y, c)


def train_for(step, model, test_ids: np.ndarray, test_y: np.ndarray, c: dict) -> dict:
    """Steps until c["seconds"] of training (evaluations left out of the clock), evaluating
    every EVAL_EVERY_S. Rank 0's clock decides, every CHECK_EVERY steps, for both ranks: a
    sharded model's forward pass is a collective, so both step and evaluate together."""
    import torch
    import torch.distributed as dist
    start = time.time()
    steps, evaluating, aucs, next_eval = 0, 0.0, [], start + EVAL_EVERY_S
    while True:
        step()
        steps += 1
        if steps % CHECK_EVERY:
            continue
        now = time.time()
        flags = torch.tensor([now - start - evaluating >= c["seconds"], now >= next_eval], dtype=torch.int32)
        dist.broadcast(flags, 0)
        if flags[0].item():
            break
        if flags[1].item():
            aucs.append(auc(model, test_ids, test_y))
            evaluating += time.time() - now
            next_eval = time.time() + EVAL_EVERY_S
    trained = time.time() - start - evaluating
    aucs.append(auc(model, test_ids, test_y))
    dist.destroy_process_group()
    return {"examples": steps * BATCH, "seconds": trained, "auc": aucs[-1], "best_auc": max(aucs)}


def run_ranks(seconds: float, run: int, timeout: float) -> dict:
    """Both ranks to the end; examples/s of both together, and rank 0's AUCs."""
    import subprocess
    spec = {"port": free_port(), "seconds": seconds, "run": run}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    ranks = [subprocess.Popen([sys.executable, __file__, "--child", json.dumps({**spec, "rank": r})], env=env,
                              stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent) for r in range(RANKS)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    if failed := [p.returncode for p in ranks if p.returncode]:
        raise subprocess.CalledProcessError(failed[0], "torchrec_peer rank")
    reports = [json.loads(out) for out in outs]
    return {"examples_per_s": sum(r["examples"] for r in reports) / max(r["seconds"] for r in reports),
            "auc": reports[0]["auc"], "best_auc": reports[0]["best_auc"], "seconds": seconds,
            "steps_per_rank": reports[0]["examples"] // BATCH}


def ours(run: int) -> dict:
    """Our 4x2-defaults job to its end, as heavy_tail_bench.py runs it."""
    import tempfile
    name, _, embeddings, rest = next(s for s in heavy_tail_bench.SETTINGS if s[0] == "4x2-defaults")
    with tempfile.TemporaryDirectory() as tmp:
        result = heavy_tail_bench.run_setting(name, embeddings, rest, Path(tmp) / "out")
    if result["exitCode"] != 0:
        raise RunFailed(f"our job ended {result['phase']}", result["exitCode"])
    return result


def rounds(count: int, timeout: float, failures: list[dict]) -> dict:
    """Ours, then TorchRec for as long as ours took, round after round."""
    pairs = []
    for run in range(count):
        mine = retried(f"sparse peers round {run + 1} distbelief", functools.partial(ours, run), failures)
        if mine is None:
            continue
        theirs = retried(f"sparse peers round {run + 1} torchrec",
                         functools.partial(run_ranks, mine["seconds"], run, timeout), failures)
        pairs.append((mine, theirs))
    both = [(a, b) for a, b in pairs if b is not None]
    side = {"distbelief": [a for a, _ in pairs], "torchrec": [b for _, b in both]}
    return {
        **{name: {key: summarize([r[key] for r in runs]) for key in ("examples_per_s", "auc", "best_auc", "seconds")}
           for name, runs in side.items()},
        "examples_per_s_ratio": summarize([a["examples_per_s"] / b["examples_per_s"] for a, b in both]),
        "auc_difference": summarize([a["auc"] - b["auc"] for a, b in both]),
        "config": {"hash_rows": HASH_ROWS, "dim": DIM, "row_values": ROW, "hidden": [HIDDEN], "batch": BATCH,
                   "lr": LR, "ranks": RANKS, "sharding": "table_wise", "tables_optimizer": "fused Adagrad (EXACT_ADAGRAD)"},
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=None, help="TorchRec alone, for this long")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(rank_main(json.loads(args.child))), flush=True)
        return 0
    if args.seconds:
        report = run_ranks(args.seconds, 0, args.timeout)
        print(f"TorchRec, 2 ranks, {args.seconds:.0f} s: {report['examples_per_s']:.0f} examples/s, "
              f"held-out AUC {report['auc']:.4f} (best {report['best_auc']:.4f})")
        return 0
    failures: list[dict] = []
    results = rounds(args.rounds, args.timeout, failures)
    for name in ("distbelief", "torchrec"):
        print(f"{name:<11} {fmt(results[name]['examples_per_s'], '.0f')} examples/s, "
              f"AUC {fmt(results[name]['auc'], '.4f')} (best {fmt(results[name]['best_auc'], '.4f')})")
    print(f"examples/s ours / TorchRec {fmt(results['examples_per_s_ratio'])}, "
          f"AUC ours - TorchRec {fmt(results['auc_difference'], '+.4f')}")
    save({"sparse_peers": results, "failures": failures}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
