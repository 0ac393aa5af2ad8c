#!/usr/bin/env python
"""Throughput against the shard count where the network is the limit (issue 40).

    sudo python benchmarks/shaped_scaling.py [--shards 1,2,4,8] [--replicas 4] [--rate 100M]
        [--features 1024] [--hidden 2048,1024] [--seconds 90] [--peer-steps 30] [--peer-only]
        [--plot docs/scale.png] [--json out.json]

One real node (tests/support/nodes.py's harness over ../shared/kube/node: containerd, runc,
the CNI bridge, kubelet, kube-proxy, CoreDNS) whose CNI chain also runs the `bandwidth`
plugin, so that every pod's link is shaped by its annotations
kubernetes.io/ingress-bandwidth and egress-bandwidth: a tc tbf on the pod's veth for what
it receives, and one on an ifb device for what it sends. The chart's operator (helm, in a
pod) runs the jobs. Shaping costs next to no CPU, so two cores are enough to make the links
the bottleneck.

For each shard count k a DistBeliefJob trains a dense MLP on generated data with --replicas
replicas (Downpour, fetchEvery and pushEvery 1, batch 64), every shard and replica pod at
--rate each way. Once every replica has trained and a warm-up has passed, the replicas'
own counters (distbelief_worker_examples_total, _bytes_in_total and _bytes_out_total,
scraped from each replica pod's :9100) over --seconds give examples/s and bytes per example.
One more job, with as many shards as replicas, pulls and pushes every 4 steps
(fetchEvery, pushEvery: DistBelief's own knob against slow links).

Then torch DDP (gloo) on pods shaped alike: the runtime image, with torch mounted read-only
from this virtualenv (a hostPath), the same MLP, batch and Adagrad, --replicas ranks.

Each step of a replica pulls the model (M bytes) and pushes a gradient of M bytes; k shards
share that, so a shard's link carries replicas*M/k each way per round of steps, a replica's
M. The shards' links are the limit while k < replicas, the replicas' own from k = replicas
on: examples/s should grow about k-fold up to there and stay flat after. A ring all-reduce
sends and receives 2(n-1)/n*M per rank and step, both ways at once.

Needs root and ../shared/kube beside the repository, as `make test-nodes`; exits 2 saying
why without them.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from figures import save

from support import controlplane, nodes
from support.cluster import CHART, RELEASE, RELEASE_NAMESPACE, helm_env

BATCH = 64
WARMUP_S = 20.0
START_S = 900.0                  # from apply to every replica training (images are on the node)
METRICS_PORT = 9100
# What containerd gives an annotated pod's tbf as its bucket: MaxUint32 bits (Kubernetes has
# no annotation for it), so a pod's first 512 MiB each way pass at the link's full speed.
BURST_BYTES = 2 ** 32 // 8
PEER_SCRIPT = """
import json, os, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
sizes, batch, steps = json.loads(os.environ["SIZES"]), int(os.environ["BATCH"]), int(os.environ["STEPS"])
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
layers = []
for fan_in, fan_out in zip(sizes, sizes[1:]):
    layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
net = DistributedDataParallel(torch.nn.Sequential(*layers[:-1]))
opt, loss = torch.optim.Adagrad(net.parameters(), lr=0.01), torch.nn.CrossEntropyLoss()
x, y = torch.randn(batch, sizes[0]), torch.randint(0, sizes[-1], (batch,))
def step():
    opt.zero_grad(); loss(net(x), y).backward(); opt.step()
for _ in range(int(os.environ["WARMUP"])):
    step()
dist.barrier(); started = time.time()
for _ in range(steps):
    step()
dist.barrier()
print(json.dumps({"rank": dist.get_rank(), "seconds": time.time() - started, "examples": steps * batch}))
"""


class Cluster:
    """One shaped node, the chart's operator on it, and kubectl."""

    def __init__(self, rate: str) -> None:
        self.rate = rate
        self.nodes = nodes.NodeCluster(layout=(("node1", ()),))
        self.helm_binary = controlplane.tool("helm")

    def __enter__(self) -> "Cluster":
        self.nodes.start()
        try:
            shape_pods(self.nodes.nodes[0])
            self.helm("install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace",
                      "--wait", "--timeout", "10m")
        except BaseException:
            self.nodes.stop(check=False)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.nodes.stop(check=exc[0] is None)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
        return self.nodes.kubectl(*args, input=input, check=check, timeout=timeout)

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def helm(self, *args: str) -> str:
        return nodes.run([str(self.helm_binary), *args], timeout=700, env=helm_env(self.nodes)).stdout

    def annotations(self) -> dict[str, str]:
        return {"kubernetes.io/ingress-bandwidth": self.rate, "kubernetes.io/egress-bandwidth": self.rate}

    def fresh_namespace(self, name: str) -> str:
        self.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=true", timeout=300)
        self.kubectl("create", "namespace", name)
        return name

    def running_pods(self, namespace: str, prefix: str) -> list[dict[str, Any]]:
        pods = self.json("get", "pods", "-n", namespace)["items"]
        return [p for p in pods if p["metadata"]["name"].startswith(prefix)
                and p["status"].get("phase") == "Running" and p["status"].get("podIP")]


def shape_pods(node: nodes.Node) -> None:
    """Chain the CNI `bandwidth` plugin after the bridge in the node's network config:
    containerd re-reads the folder when a file in it changes, and pods made from then on get
    the links their annotations ask for."""
    (conflist,) = (node.dir / "cni" / "net.d").glob("*.conflist")
    config = json.loads(conflist.read_text())
    if not any(plugin["type"] == "bandwidth" for plugin in config["plugins"]):
        config["plugins"].append({"type": "bandwidth", "capabilities": {"bandwidth": True}})
        conflist.write_text(json.dumps(config))


def assert_shaped(pod_count: int, rate: str) -> None:
    """Every pod's link has its tbf: one on its host-side veth, one on its ifb device."""
    shown = nodes.run(["tc", "qdisc", "show"], timeout=30).stdout
    tbfs = [line for line in shown.splitlines() if " tbf " in line]
    if len(tbfs) < 2 * pod_count:
        raise RuntimeError(f"{len(tbfs)} tbf qdiscs for {pod_count} shaped pods ({rate}): the CNI bandwidth "
                           f"plugin did not shape them:\n{shown[-3000:]}")
    print(f"shaped: {tbfs[0].strip()}", flush=True)


def link_bytes_per_s(rate: str) -> float:
    """The bytes a second of a bandwidth annotation's quantity (100M: 100 Mbit/s)."""
    units = {"K": 1e3, "M": 1e6, "G": 1e9}
    return float(rate[:-1]) * units[rate[-1]] / 8 if rate[-1] in units else float(rate) / 8


def scrape(ip: str) -> dict[str, float]:
    """A replica's counters: examples, bytes in and out."""
    with urllib.request.urlopen(f"http://{ip}:{METRICS_PORT}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    wanted = {"distbelief_worker_examples_total": "examples", "distbelief_worker_bytes_in_total": "bytes_in",
              "distbelief_worker_bytes_out_total": "bytes_out"}
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            counters[wanted[name]] = float(value)
    return counters


def sample(ips: list[str]) -> tuple[float, dict[str, float]]:
    totals: dict[str, float] = {"examples": 0.0, "bytes_in": 0.0, "bytes_out": 0.0}
    for ip in ips:
        for key, value in scrape(ip).items():
            totals[key] += value
    return time.monotonic(), totals


def job(name: str, args: argparse.Namespace, shards: int, annotations: dict[str, str], every: int = 1,
        ) -> dict[str, Any]:
    resources = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}
    template = {"metadata": {"annotations": annotations}}
    return {
        "apiVersion": "distbelief.io/v1alpha1", "kind": "DistBeliefJob", "metadata": {"name": name},
        "spec": {
            "model": {"type": "mlp", "hiddenLayers": args.hidden, "activation": "relu"},
            "data": {"source": f"synthetic:features={args.features},classes={args.classes},samples=4096,seed=7",
                     "testFraction": 0.1, "maxEvalExamples": 256},
            "training": {"batchSize": BATCH, "learningRate": 0.01, "maxSteps": 10 ** 9, "evalEverySeconds": 3600,
                         "fetchEvery": every, "pushEvery": every},
            "parameterServers": {"shards": shards, "resources": resources, "template": template,
                                 "checkpoint": {"everySeconds": 3600}},
            "workers": {"replicas": args.replicas, "resources": resources, "template": template},
        },
    }


def measure_ours(cluster: Cluster, args: argparse.Namespace, shards: int, every: int = 1) -> dict[str, float]:
    """examples/s and bytes per example of one job with `shards` shards, fetchEvery and
    pushEvery `every`, over args.seconds."""
    namespace = cluster.fresh_namespace(f"shaped-{shards}-{every}")
    name = f"shaped{shards}e{every}"
    doc = job(name, args, shards, cluster.annotations(), every)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc))
    ips = wait_training(cluster, namespace, f"{name}-worker-", args.replicas)
    assert_shaped(args.replicas + shards, args.rate)
    time.sleep(WARMUP_S)
    start, before = sample(ips)
    time.sleep(args.seconds)
    end, after = sample(ips)
    cluster.kubectl("delete", "namespace", namespace, "--wait=true", timeout=300)
    examples = after["examples"] - before["examples"]
    moved = (after["bytes_in"] - before["bytes_in"]) + (after["bytes_out"] - before["bytes_out"])
    figures = {"examples_per_s": examples / (end - start), "bytes_per_example": moved / max(examples, 1.0),
               "replica_bytes_in_per_s": (after["bytes_in"] - before["bytes_in"]) / (end - start) / args.replicas}
    if figures["replica_bytes_in_per_s"] > 1.05 * link_bytes_per_s(args.rate):
        raise RuntimeError(f"{shards} shard(s): the replicas received {figures['replica_bytes_in_per_s']:.0f} B/s "
                           f"each, over their {args.rate} links: the window began inside the pods' bursts")
    print(f"{shards} shard(s), fetchEvery/pushEvery {every}: {figures['examples_per_s']:.1f} examples/s, "
          f"{figures['bytes_per_example'] / 1e6:.2f} MB per example", flush=True)
    return figures


def wait_training(cluster: Cluster, namespace: str, prefix: str, replicas: int) -> list[str]:
    """The replicas' pod IPs, once every one of them has trained an example."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        ips = [p["status"]["podIP"] for p in cluster.running_pods(namespace, prefix)]
        if len(ips) == replicas:
            try:
                if all(scrape(ip).get("examples", 0) > 0 for ip in ips):
                    return ips
            except OSError:
                pass
        time.sleep(2)
    pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False)
    raise RuntimeError(f"{prefix}*: not {replicas} replicas training within {START_S:.0f} s:\n{pods}")


def peer_pod(name: str, rank: int, master: str, args: argparse.Namespace, annotations: dict[str, str],
             torch_path: str) -> dict[str, Any]:
    env = {"RANK": str(rank), "WORLD_SIZE": str(args.replicas), "MASTER_ADDR": master, "MASTER_PORT": "29500",
           "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/peer/site-packages",
           "SIZES": json.dumps([args.features, *args.hidden, args.classes]), "BATCH": str(BATCH),
           "STEPS": str(args.peer_steps), "WARMUP": str(peer_warmup(args))}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "ddp-peer"}, "annotations": annotations},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "rank", "image": nodes.RUNTIME_IMAGE, "imagePullPolicy": "Never",
                "command": ["python", "/peer/script/ddp.py"],
                "env": [{"name": k, "value": v} for k, v in env.items()],
                "volumeMounts": [{"name": "torch", "mountPath": "/peer/site-packages", "readOnly": True},
                                 {"name": "script", "mountPath": "/peer/script"}]}],
            "volumes": [{"name": "torch", "hostPath": {"path": torch_path, "type": "Directory"}},
                        {"name": "script", "configMap": {"name": "ddp-script"}}],
        },
    }


def peer_warmup(args: argparse.Namespace) -> int:
    """Steps before DDP's timed ones: enough to empty the pods' burst buckets (a ring
    all-reduce sends 2(n-1)/n of the gradient per rank and step), so that the timed steps
    run at the shaped rate, as our jobs' windows do."""
    ring_bytes = 2 * (args.replicas - 1) / args.replicas * 4 * parameters(args)
    return int(BURST_BYTES / ring_bytes) + 5


def measure_ddp(cluster: Cluster, args: argparse.Namespace) -> dict[str, float] | None:
    """torch DDP's examples/s on pods shaped alike; None (said why) without torch here."""
    try:
        import torch
    except ImportError:
        print("torch DDP: skipped, no torch in this environment (make bench installs it)", flush=True)
        return None
    torch_path = str(Path(torch.__file__).resolve().parents[1])
    namespace = cluster.fresh_namespace("shaped-ddp")
    cluster.kubectl("create", "configmap", "ddp-script", "-n", namespace, "--from-literal", f"ddp.py={PEER_SCRIPT}")
    annotations = cluster.annotations()

    def apply(rank: int, master: str) -> None:
        pod = peer_pod(f"rank{rank}", rank, master, args, annotations, torch_path)
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))

    apply(0, "127.0.0.1")   # rank 0 listens; the others are told its address
    deadline = time.monotonic() + START_S
    while not (ranks := cluster.running_pods(namespace, "rank0")):
        if time.monotonic() > deadline:
            raise RuntimeError("torch DDP: rank 0 never ran:\n" + cluster.kubectl("describe", "pods", "-n", namespace))
        time.sleep(1)
    assert_shaped(1, args.rate)   # rank 0, while it waits for the others (a pod's qdiscs go with it)
    for rank in range(1, args.replicas):
        apply(rank, ranks[0]["status"]["podIP"])
    reports = [peer_report(cluster, namespace, f"rank{rank}", deadline) for rank in range(args.replicas)]
    cluster.kubectl("delete", "namespace", namespace, "--wait=true", timeout=300)
    examples = sum(r["examples"] for r in reports)
    figures = {"examples_per_s": examples / max(r["seconds"] for r in reports)}
    print(f"torch DDP: {figures['examples_per_s']:.1f} examples/s", flush=True)
    return figures


def peer_report(cluster: Cluster, namespace: str, pod: str, deadline: float) -> dict[str, float]:
    while (phase := cluster.json("get", "pod", pod, "-n", namespace)["status"].get("phase")) not in (
            "Succeeded", "Failed"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"torch DDP: {pod} still {phase}")
        time.sleep(2)
    log = cluster.kubectl("logs", "-n", namespace, pod)
    if phase != "Succeeded":
        raise RuntimeError(f"torch DDP: {pod} failed:\n{log[-3000:]}")
    return json.loads(log.strip().splitlines()[-1])


def parameters(args: argparse.Namespace) -> int:
    sizes = [args.features, *args.hidden, args.classes]
    return sum(a * b + b for a, b in zip(sizes, sizes[1:]))


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ours = results["ours"]
    shards = sorted(int(k) for k in ours)
    rates = [ours[str(k)]["examples_per_s"] for k in shards]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(shards, rates, "o-", label="distbelief (Downpour)")
    ax.plot(shards, [rates[0] * min(k, results["replicas"]) for k in shards], ":", color="grey",
            label="k-fold one shard's, up to k = replicas")
    if every := results.get("every_4"):
        ax.plot([every["shards"]], [every["examples_per_s"]], "s", color="tab:green",
                label="distbelief, fetchEvery = pushEvery = 4")
    if results.get("ddp"):
        ax.axhline(results["ddp"]["examples_per_s"], color="tab:red", ls="--", label="torch DDP (gloo)")
    ax.set(xlabel="shards", ylabel="examples/s", xticks=shards,
           title=f"{results['replicas']} replicas, every pod's link {results['rate']}bit/s each way, "
                 f"{results['parameters'] / 1e6:.1f}M parameters")
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", default="1,2,4,8")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rate", default="100M", help="every pod's link, each way (the annotations' quantity)")
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--hidden", default="2048,1024")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--seconds", type=float, default=90.0, help="the measured window of each job")
    p.add_argument("--peer-steps", type=int, default=30, help="DDP's timed steps (after its warm-up)")
    p.add_argument("--peer-only", action="store_true", help="measure torch DDP alone")
    p.add_argument("--plot", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.hidden = [int(h) for h in args.hidden.split(",")]
    reason = nodes.why_unavailable() or next((f"no {tool}: `make kube-tools` fetches it" for tool in ("kubectl", "helm")
                                              if controlplane.tool(tool) is None), None)
    if reason:
        print(f"shaped_scaling: {reason}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"rate": args.rate, "replicas": args.replicas, "batch": BATCH,
                               "parameters": parameters(args), "ours": {}}
    with Cluster(args.rate) as cluster:
        if not args.peer_only:
            for shards in (int(k) for k in args.shards.split(",")):
                results["ours"][str(shards)] = measure_ours(cluster, args, shards)
            # DistBelief's own knob against the links: a pull and a push every 4 steps.
            results["every_4"] = {"shards": args.replicas, **measure_ours(cluster, args, args.replicas, every=4)}
        results["ddp"] = measure_ddp(cluster, args)
    if results["ours"]:
        first = results["ours"][min(results["ours"], key=int)]["examples_per_s"]
        for figures in results["ours"].values():
            figures["speedup"] = figures["examples_per_s"] / first
    save({"shaped_scaling": results}, args.json)
    if args.plot and results["ours"]:
        plot(results, args.plot)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.TimeoutExpired as exc:
        print(f"shaped_scaling: {exc}", file=sys.stderr)
        sys.exit(1)
