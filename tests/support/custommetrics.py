"""The custom metrics API on the nodes tier, for autoscaling on a job's own signal:

    Prometheus         on this machine: scrapes the model replicas' `metrics` port across the
                       nodes, labelling each series with its namespace and pod, as the
                       Prometheus Operator's PodMonitor (the distbelief chart's
                       metrics.podMonitor) does; it finds them in a file kept current from
                       the API (Debian's Prometheus 2.42 lacks Kubernetes discovery)
    prometheus-adapter a Deployment in kube-system built from its module (nodeaddons), behind
                       the APIService v1beta1.custom.metrics.k8s.io, answering from that
                       Prometheus by the rules users install: charts/prometheus-adapter-values.yaml

    with serving(cluster) as api: ...     # both up and Available; both gone afterwards

The APIService goes before the test's namespaces do: an aggregated API that does not
answer would hold up their deletion.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import yaml

from support import nodeaddons
from support.nodes import NodeCluster, host_ip, run
from support.paths import REPO

PORT = 9390
ADAPTER_VALUES = REPO / "charts" / "prometheus-adapter-values.yaml"


def scrape_config(targets: Path) -> str:
    return yaml.safe_dump({"global": {"scrape_interval": "5s"}, "scrape_configs": [
        {"job_name": "distbelief-replicas", "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "5s"}]}]})


def replica_targets(cluster: NodeCluster) -> list[dict[str, Any]]:
    """Every running model replica's metrics port, labelled as a PodMonitor labels it."""
    pods = json.loads(cluster.kubectl("get", "pods", "-A", "-l", "distbelief.io/role=worker", "-o", "json"))
    targets = []
    for pod in pods["items"]:
        ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])
                 if p.get("name") == "metrics"]
        ip = (pod.get("status") or {}).get("podIP")
        if ports and ip and pod["status"].get("phase") == "Running":
            meta = pod["metadata"]
            targets.append({"targets": [f"{ip}:{ports[0]}"], "labels": {
                "namespace": meta["namespace"], "pod": meta["name"],
                "distbelief_io_job": meta["labels"].get("distbelief.io/job", "")}})
    return targets


@contextlib.contextmanager
def discovering(cluster: NodeCluster, targets: Path) -> Iterator[None]:
    """Keeps the targets file current from the API every 2 s (Prometheus's file discovery:
    Debian's Prometheus is built without its Kubernetes discovery)."""
    stop = threading.Event()

    def refresh() -> None:
        while not stop.is_set():
            try:
                fresh = targets.with_suffix(".tmp")
                fresh.write_text(json.dumps(replica_targets(cluster)))
                fresh.replace(targets)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass   # the API busy: the next round
            stop.wait(2)

    targets.write_text("[]")
    thread = threading.Thread(target=refresh, name="replica-targets", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)


def adapter_manifests(image: str, prometheus_url: str) -> str:
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    config = textwrap.indent(yaml.safe_dump({"rules": rules}), "    ").lstrip()
    return (nodeaddons.manifests(nodeaddons.PROMETHEUS_ADAPTER, image)
            .replace("__PROMETHEUS_URL__", prometheus_url).replace("__ADAPTER_RULES__", config))


@contextlib.contextmanager
def prometheus(folder: Path) -> Iterator[str]:
    """A Prometheus scraping the replicas; yields its URL as pods reach it."""
    if shutil.which("prometheus") is None:
        raise RuntimeError("no prometheus on PATH: tools/fetch-prometheus installs it (make test-nodes runs it)")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prometheus.yml").write_text(scrape_config(folder / "targets.json"))
    with open(folder / "prometheus.log", "ab") as log:
        server = subprocess.Popen(["prometheus", f"--config.file={folder / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={folder / 'tsdb'}", f"--web.listen-address=0.0.0.0:{PORT}"],
                                  stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ready(f"http://127.0.0.1:{PORT}/-/ready"):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready:\n{(folder / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield f"http://{host_ip()}:{PORT}/"
    finally:
        server.terminate()
        server.wait(timeout=30)


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def serving(cluster: NodeCluster) -> Iterator[None]:
    """Prometheus and prometheus-adapter up, the custom metrics API Available; then both gone."""
    image, note = nodeaddons.build_image(nodeaddons.PROMETHEUS_ADAPTER, cluster.run_dir, run)
    if image is None:
        raise RuntimeError(f"prometheus-adapter could not be built: {note}")
    cluster.load_images([image])
    folder = cluster.run_dir / "prometheus"
    with prometheus(folder) as url, discovering(cluster, folder / "targets.json"):
        manifests = adapter_manifests(image, url)
        cluster.kubectl("apply", "-f", "-", input=manifests)
        try:
            cluster.kubectl("-n", "kube-system", "rollout", "status", "deployment/prometheus-adapter",
                            "--timeout=300s", timeout=330)
            cluster.kubectl("wait", "--for=condition=Available", "apiservice/v1beta1.custom.metrics.k8s.io",
                            "--timeout=300s", timeout=330)
            yield
        finally:
            cluster.kubectl("delete", "--wait=true", "-f", "-", input=manifests, timeout=300, check=False)
