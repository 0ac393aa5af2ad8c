"""The operator for real: `distbelief operator` as a subprocess, against the Kubernetes API
emulator on loopback, driven as a user would (kubectl where it is installed) while the
test plays the kubelet (children's status) and the chief (shard 0's metrics endpoint,
served with the runtime's own metric classes)."""

from __future__ import annotations

import base64
import copy
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import prometheus_client as prom
import pytest
import yaml

from distbelief.runtime import keys
from distbelief.runtime.observe.metrics import ChiefMetrics, ShardMetrics
from kube import KubeEmulator
from kube.plugin import project_emulator

from conftest import REPO, load_example

pytestmark = pytest.mark.floors  # also run against the lowest dependency versions

JOBS = "distbelief.io/v1alpha1/distbeliefjobs"
KUBECTL = shutil.which("kubectl") or str(REPO / ".cache" / "kube-tools" / "bin" / "kubectl")
HAVE_KUBECTL = os.access(KUBECTL, os.X_OK)
WAIT = 30.0


class Chiefs:
    """Shard 0's /metrics for every job, at /<job>/metrics, as the operator scrapes it."""

    def __init__(self) -> None:
        self.registries: dict[str, prom.CollectorRegistry] = {}
        self.metrics: dict[str, tuple[ShardMetrics, ChiefMetrics]] = {}
        chiefs = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                job = self.path.strip("/").split("/")[0]
                registry = chiefs.registries.get(job)
                body = prom.generate_latest(registry) if registry else b""
                self.send_response(200 if registry else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/{{job}}/metrics"

    def of(self, job: str) -> tuple[ShardMetrics, ChiefMetrics]:
        if job not in self.metrics:
            registry = prom.CollectorRegistry()
            self.registries[job] = registry
            self.metrics[job] = (ShardMetrics(registry, 0), ChiefMetrics(registry))
        return self.metrics[job]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Operator:
    def __init__(self, kube: KubeEmulator, chiefs: Chiefs, log_path: Path) -> None:
        self.kube, self.chiefs, self.log_path = kube, chiefs, log_path
        self.liveness = f"http://127.0.0.1:{_free_port()}/healthz"
        self.process: subprocess.Popen | None = None

    def start(self) -> "Operator":
        env = self.kube.env(DISTBELIEF_STATUS_INTERVAL="0.5", DISTBELIEF_METRICS_URL=self.chiefs.url)
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "distbelief.operator.cli", "operator", "--namespace", "default",
             "--standalone", "--liveness", self.liveness], env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KubeEmulator, Chiefs, Operator]]:
    folder = tmp_path_factory.mktemp("operator")
    kube = project_emulator().start()
    kube.write_kubeconfig(folder / "kubeconfig")
    chiefs = Chiefs()
    operator = Operator(kube, chiefs, folder / "operator.log").start()
    try:
        yield kube, chiefs, operator
    finally:
        operator.stop()
        kube.stop()
        chiefs.server.shutdown()
        print((folder / "operator.log").read_text()[-5000:])


def user(kube: KubeEmulator, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """kubectl as a user runs it."""
    return subprocess.run([KUBECTL, "--kubeconfig", str(kube.kubeconfig), *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def apply(kube: KubeEmulator, doc: dict[str, Any]) -> dict[str, Any]:
    if HAVE_KUBECTL:
        done = user(kube, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(doc))
        assert done.returncode == 0, done.stderr
    else:
        kube.create(JOBS, doc)
    return kube.get(JOBS, doc["metadata"]["name"])


def patch_job(kube: KubeEmulator, name: str, patch: dict[str, Any]) -> None:
    if HAVE_KUBECTL:
        done = user(kube, "patch", "dbj", name, "--type", "merge", "-p", json.dumps(patch))
        assert done.returncode == 0, done.stderr
    else:
        kube.patch(JOBS, name, patch)


def new_job(name: str, **spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(load_example("digits-mlp.yaml"))
    doc["metadata"]["name"] = name
    for key, value in spec.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
    return doc


def wait(kube: KubeEmulator, resource: str, name: str, condition: Callable[[Any], bool] = lambda o: o is not None,
         ) -> Any:
    return kube.wait_for(resource, name, condition=condition, timeout=WAIT)


def phase_is(phase: str) -> Callable[[Any], bool]:
    return lambda job: job is not None and (job.get("status") or {}).get("phase") == phase


def condition_holds(kind: str) -> Callable[[Any], bool]:
    return lambda job: any(c["type"] == kind and c["status"] == "True"
                           for c in ((job or {}).get("status") or {}).get("conditions", []))


def kubelet_ready(kube: KubeEmulator, job: str, shards: int, workers: int) -> None:
    kube.patch_status("apps/v1/statefulsets", f"{job}-ps", {"replicas": shards, "readyReplicas": shards})
    kube.patch_status("apps/v1/deployments", f"{job}-worker", {"replicas": workers, "readyReplicas": workers})


def events_of(kube: KubeEmulator, name: str) -> list[dict[str, Any]]:
    return [e for e in kube.list("v1/events", "default") if e.get("involvedObject", {}).get("name") == name]


def event_reasons(kube: KubeEmulator, name: str, wanted: set[str]) -> set[str]:
    """The reasons of name's Events, once they include wanted (or WAIT has passed): kopf
    posts Events from a queue of its own, so one may land after the status patch."""
    deadline = time.monotonic() + WAIT
    while True:
        reasons = {e["reason"] for e in events_of(kube, name)}
        if wanted <= reasons or time.monotonic() >= deadline:
            return reasons
        time.sleep(0.1)


CHILDREN = [("v1/secrets", "{}-keys"), ("v1/configmaps", "{}-config"), ("v1/services", "{}-ps"),
            ("apps/v1/statefulsets", "{}-ps"), ("apps/v1/deployments", "{}-worker")]


def test_create_makes_the_children_owned_by_the_job(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, operator = cluster
    job = apply(kube, new_job("create"))
    for resource, pattern in CHILDREN:
        child = wait(kube, resource, pattern.format("create"))
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("DistBeliefJob", job["metadata"]["uid"], True)
    assert wait(kube, "apps/v1/statefulsets", "create-ps")["spec"]["replicas"] == 2
    assert wait(kube, "apps/v1/deployments", "create-worker")["spec"]["replicas"] == 3
    job = wait(kube, JOBS, "create", lambda j: j and (j.get("status") or {}).get("conditions"))
    created = next(c for c in job["status"]["conditions"] if c["type"] == "Created")
    assert created["status"] == "True"
    assert job["metadata"]["annotations"]["distbelief.io/shards"] == "2"
    assert any(e["reason"] == "ChildrenApplied" for e in events_of(kube, "create"))
    with urllib.request.urlopen(operator.liveness, timeout=5) as response:
        assert response.status == 200


def test_a_new_jobs_children_are_created_without_reading_them_first(
        cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, _ = cluster
    before = len(kube.requests)
    apply(kube, new_job("lean"))
    for resource, pattern in CHILDREN:
        wait(kube, resource, pattern.format("lean"))
    requests = kube.requests[before:]
    creates = [i for i, r in enumerate(requests) if r.method == "POST" and r.code == 201
               and not r.path.endswith(("/distbeliefjobs", "/events"))]
    assert len(creates) >= len(CHILDREN)
    reads = [r for r in requests[:creates[-1]] if r.method == "GET" and "/lean-" in r.path]
    assert reads == [], "a new job's children were read before they were made"


def test_the_keys_secret_is_made_once_and_never_rotated(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, _ = cluster
    apply(kube, new_job("keys"))
    secret = wait(kube, "v1/secrets", "keys-keys")
    assert secret["immutable"] is True and secret["type"] == "Opaque"
    files = {name: base64.b64decode(value).decode() for name, value in secret["data"].items()}
    assert sorted(files) == sorted(keys.FILES)
    made = keys.JobKeys(server_public=files[keys.SERVER_PUBLIC].strip().encode(),
                        server_secret=files[keys.SERVER_SECRET].strip().encode(),
                        client_public=files[keys.CLIENT_PUBLIC].strip().encode(),
                        client_secret=files[keys.CLIENT_SECRET].strip().encode(),
                        chief_public=files[keys.CHIEF_PUBLIC].strip().encode(),
                        chief_secret=files[keys.CHIEF_SECRET].strip().encode())
    made._check_pairs("the Secret")  # real, matching Curve keypairs
    sts = wait(kube, "apps/v1/statefulsets", "keys-ps")
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["keys"]["secret"]["secretName"] == "keys-keys"
    assert "KeysCreated" in event_reasons(kube, "keys", {"KeysCreated"})
    patch_job(kube, "keys", {"spec": {"image": "example.org/distbelief:2"}})  # reconcile runs again
    wait(kube, "apps/v1/deployments", "keys-worker",
         lambda d: d and d["spec"]["template"]["spec"]["containers"][0]["image"] == "example.org/distbelief:2")
    assert kube.get("v1/secrets", "keys-keys")["data"] == secret["data"]
    assert [e["reason"] for e in events_of(kube, "keys")].count("KeysCreated") == 1


def test_the_keys_secret_is_recorded_on_the_job(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, _ = cluster
    apply(kube, new_job("owned"))
    secret = wait(kube, "v1/secrets", "owned-keys")
    job = wait(kube, JOBS, "owned", lambda j: j and "distbelief.io/keys-secret-uid" in j["metadata"].get("annotations", {}))
    assert job["metadata"]["annotations"]["distbelief.io/keys-secret-uid"] == secret["metadata"]["uid"]
    assert secret["metadata"]["labels"]["distbelief.io/job"] == "owned"
    # The operator made it without ever reading a Secret.
    assert not [r for r in kube.requests if r.method == "GET" and "/secrets" in r.path]


def test_a_foreign_keys_secret_is_refused(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, _ = cluster
    planted = keys.JobKeys.generate().files()
    kube.create("v1/secrets", {"apiVersion": "v1", "kind": "Secret",
                               "metadata": {"name": "planted-keys", "namespace": "default",
                                            "labels": {"distbelief.io/job": "planted"}},
                               "data": {n: base64.b64encode(t.encode()).decode() for n, t in planted.items()}})
    apply(kube, new_job("planted"))
    assert "KeysSecretForeign" in event_reasons(kube, "planted", {"KeysSecretForeign"})
    time.sleep(1.0)   # the handler has given up; nothing may follow the refusal
    for resource, pattern in CHILDREN[1:]:
        assert kube.get(resource, pattern.format("planted")) is None, resource
    assert "KeysCreated" not in {e["reason"] for e in events_of(kube, "planted")}
    assert "distbelief.io/keys-secret-uid" not in (kube.get(JOBS, "planted")["metadata"].get("annotations") or {})


def test_status_follows_the_children_and_the_chief(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, chiefs, _ = cluster
    apply(kube, new_job("status"))
    wait(kube, "apps/v1/deployments", "status-worker")
    job = wait(kube, JOBS, "status", phase_is("Pending"))
    assert job["status"]["parameterServers"] == {"shards": 2, "ready": 0}
    kubelet_ready(kube, "status", shards=2, workers=3)
    shard, chief = chiefs.of("status")
    shard.global_step.set(1234)
    shard.examples_per_second.set(5000)
    chief.accuracy.set(0.93)
    chief.loss.set(0.25)
    job = wait(kube, JOBS, "status", lambda j: phase_is("Running")(j) and j["status"].get("globalStep") == 1234)
    status = job["status"]
    assert (status["accuracy"], status["loss"], status["examplesPerSecond"]) == (0.93, 0.25, 5000)
    assert status["workers"] == {"replicas": 3, "ready": 3}
    assert status["observedGeneration"] == job["metadata"]["generation"]
    assert status["selector"] == "distbelief.io/job=status,distbelief.io/role=worker"
    assert {"Pending", "Running"} <= event_reasons(kube, "status", {"Pending", "Running"})
    if HAVE_KUBECTL:
        table = user(kube, "get", "dbj", "status")
        assert table.returncode == 0, table.stderr
        assert "Running" in table.stdout and "1234" in table.stdout


def test_scale_and_autoscaling_go_through_the_spec(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, _ = cluster
    apply(kube, new_job("scale"))
    wait(kube, "apps/v1/deployments", "scale-worker")
    if HAVE_KUBECTL:
        done = user(kube, "scale", "dbj/scale", "--replicas=5")
        assert done.returncode == 0, done.stderr
    else:
        kube.patch(JOBS, "scale", {"spec": {"replicas": 5}}, subresource="scale")
    assert kube.get(JOBS, "scale")["spec"]["workers"]["replicas"] == 5
    wait(kube, "apps/v1/deployments", "scale-worker", lambda d: d and d["spec"]["replicas"] == 5)
    patch_job(kube, "scale", {"spec": {"workers": {"autoscaling": {"minReplicas": 2, "maxReplicas": 6}}}})
    hpa = wait(kube, "autoscaling/v2/horizontalpodautoscalers", "scale-worker")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "distbelief.io/v1alpha1", "kind": "DistBeliefJob",
                                             "name": "scale"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    patch_job(kube, "scale", {"spec": {"workers": {"autoscaling": None}}})
    wait(kube, "autoscaling/v2/horizontalpodautoscalers", "scale-worker", lambda h: h is None)


def test_spec_updates_roll_out_and_a_reshard_is_refused(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, _ = cluster
    apply(kube, new_job("update"))
    wait(kube, "apps/v1/statefulsets", "update-ps")
    patch_job(kube, "update", {"spec": {"image": "example.org/distbelief:2"}})

    def image_is(obj: Any) -> bool:
        return obj and obj["spec"]["template"]["spec"]["containers"][0]["image"] == "example.org/distbelief:2"

    wait(kube, "apps/v1/statefulsets", "update-ps", image_is)
    wait(kube, "apps/v1/deployments", "update-worker", image_is)
    patch_job(kube, "update", {"spec": {"parameterServers": {"shards": 3}}})

    job = wait(kube, JOBS, "update", condition_holds("ShardCountLocked"))
    message = next(c["message"] for c in job["status"]["conditions"] if c["type"] == "ShardCountLocked")
    assert "from 2 to 3" in message
    assert kube.get("apps/v1/statefulsets", "update-ps")["spec"]["replicas"] == 2
    assert any(e["reason"] == "ShardCountLocked" and e["type"] == "Warning" for e in events_of(kube, "update"))


def test_a_partitioned_job_scales_every_partition_and_keeps_its_partition_count(
        cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, _ = cluster
    doc = copy.deepcopy(load_example("digits-partitioned.yaml"))
    doc["metadata"]["name"] = "parts"
    apply(kube, doc)
    partitions = ["parts-worker-p0", "parts-worker-p1"]
    for name in partitions:
        deployment = wait(kube, "apps/v1/deployments", name)
        assert deployment["spec"]["replicas"] == 3
        assert deployment["spec"]["selector"]["matchLabels"]["distbelief.io/partition"] == name[-1]
    assert kube.get("apps/v1/deployments", "parts-worker") is None
    assert wait(kube, JOBS, "parts", lambda j: j and "distbelief.io/partitions" in j["metadata"].get(
        "annotations", {}))["metadata"]["annotations"]["distbelief.io/partitions"] == "2"
    # A replica is one pod of each partition: the status counts the partition with the fewest.
    kube.patch_status("apps/v1/statefulsets", "parts-ps", {"replicas": 2, "readyReplicas": 2})
    kube.patch_status("apps/v1/deployments", "parts-worker-p0", {"replicas": 3, "readyReplicas": 3})
    kube.patch_status("apps/v1/deployments", "parts-worker-p1", {"replicas": 3, "readyReplicas": 1})
    job = wait(kube, JOBS, "parts", phase_is("Running"))
    assert job["status"]["workers"] == {"replicas": 3, "ready": 1}
    if HAVE_KUBECTL:
        done = user(kube, "scale", "dbj/parts", "--replicas=5")
        assert done.returncode == 0, done.stderr
    else:
        kube.patch(JOBS, "parts", {"spec": {"replicas": 5}}, subresource="scale")
    for name in partitions:
        wait(kube, "apps/v1/deployments", name, lambda d: d and d["spec"]["replicas"] == 5)
    patch_job(kube, "parts", {"spec": {"model": {"partitions": 1}}})

    job = wait(kube, JOBS, "parts", condition_holds("PartitionCountLocked"))
    message = next(c["message"] for c in job["status"]["conditions"] if c["type"] == "PartitionCountLocked")
    assert message.startswith("spec.model.partitions changed from 2 to 1: repartitioning a job is not supported")
    assert "PartitionCountLocked" in event_reasons(kube, "parts", {"PartitionCountLocked"})
    assert kube.get("apps/v1/deployments", "parts-worker") is None
    assert all(kube.get("apps/v1/deployments", name)["spec"]["replicas"] == 5 for name in partitions)


def test_suspend_scales_to_zero_and_resume_comes_back(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, _ = cluster
    apply(kube, new_job("pause"))
    wait(kube, "apps/v1/deployments", "pause-worker")
    patch_job(kube, "pause", {"spec": {"runPolicy": {"suspend": True}}})
    wait(kube, "apps/v1/statefulsets", "pause-ps", lambda s: s and s["spec"]["replicas"] == 0)
    wait(kube, "apps/v1/deployments", "pause-worker", lambda d: d and d["spec"]["replicas"] == 0)
    wait(kube, JOBS, "pause", phase_is("Suspended"))
    patch_job(kube, "pause", {"spec": {"runPolicy": {"suspend": False}}})
    wait(kube, "apps/v1/statefulsets", "pause-ps", lambda s: s and s["spec"]["replicas"] == 2)
    wait(kube, "apps/v1/deployments", "pause-worker", lambda d: d and d["spec"]["replicas"] == 3)
    wait(kube, JOBS, "pause", phase_is("Pending"))


def test_completion_succeeds_and_scales_down(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, chiefs, _ = cluster
    apply(kube, new_job("finish"))
    wait(kube, "apps/v1/deployments", "finish-worker")
    kubelet_ready(kube, "finish", shards=2, workers=3)
    shard, chief = chiefs.of("finish")
    shard.global_step.set(8000)
    chief.accuracy.set(0.98)
    chief.finished.labels(reason="MaxStepsReached", outcome="Succeeded").set(1)
    job = wait(kube, JOBS, "finish", phase_is("Succeeded"))
    assert job["status"]["completionTime"]
    succeeded = next(c for c in job["status"]["conditions"] if c["type"] == "Succeeded")
    assert succeeded["reason"] == "MaxStepsReached"
    wait(kube, "apps/v1/deployments", "finish-worker", lambda d: d and d["spec"]["replicas"] == 0)
    wait(kube, "apps/v1/statefulsets", "finish-ps", lambda s: s and s["spec"]["replicas"] == 0)
    # A later spec change does not revive a finished job.
    patch_job(kube, "finish", {"spec": {"workers": {"replicas": 4}}})
    time.sleep(2)  # give the operator time to (wrongly) act; the assertion is on state, not time
    assert kube.get("apps/v1/deployments", "finish-worker")["spec"]["replicas"] == 0
    assert any(e["reason"] == "MaxStepsReached" for e in events_of(kube, "finish"))


def test_a_crash_looping_shard_fails_the_job(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, _ = cluster
    apply(kube, new_job("crash"))
    wait(kube, "apps/v1/statefulsets", "crash-ps")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "crash-ps-0", "namespace": "default",
        "labels": {"distbelief.io/job": "crash", "distbelief.io/role": "ps"}},
        "spec": {"containers": [{"name": "ps", "image": "x"}]}}
    kube.create("v1/pods", pod)
    kube.patch_status("v1/pods", "crash-ps-0", {"containerStatuses": [
        {"name": "ps", "restartCount": 4, "ready": False, "image": "x", "imageID": "", "started": False}]})
    job = wait(kube, JOBS, "crash", phase_is("Failed"))
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    wait(kube, "apps/v1/deployments", "crash-worker", lambda d: d and d["spec"]["replicas"] == 0)


def test_a_config_error_in_a_pod_fails_the_job_as_invalid_config(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, _ = cluster
    apply(kube, new_job("badcfg"))
    wait(kube, "apps/v1/deployments", "badcfg-worker")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "badcfg-worker-7d9f-x2", "namespace": "default",
        "labels": {"distbelief.io/job": "badcfg", "distbelief.io/role": "worker"}},
        "spec": {"containers": [{"name": "worker", "image": "x"}]}}
    kube.create("v1/pods", pod)
    kube.patch_status("v1/pods", "badcfg-worker-7d9f-x2", {"containerStatuses": [
        {"name": "worker", "restartCount": 0, "ready": False, "image": "x", "imageID": "", "started": False,
         "state": {"terminated": {"exitCode": 2, "message": "error: npz:/data/d.npz: labels skip 2..6"}}}]})
    job = wait(kube, JOBS, "badcfg", phase_is("Failed"))
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidConfig"
    assert failed["message"] == "badcfg-worker-7d9f-x2: error: npz:/data/d.npz: labels skip 2..6"
    wait(kube, "apps/v1/statefulsets", "badcfg-ps", lambda s: s and s["spec"]["replicas"] == 0)


def test_a_model_too_large_for_its_pods_gets_a_warning_event(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, _ = cluster
    apply(kube, new_job("huge", model={"hiddenLayers": [65536, 65536, 65536]}))
    assert "MemoryLimitLow" in event_reasons(kube, "huge", {"MemoryLimitLow"})
    warning = next(e for e in events_of(kube, "huge") if e["reason"] == "MemoryLimitLow")
    assert warning["type"] == "Warning" and "is likely too small" in warning["message"]
    wait(kube, "apps/v1/statefulsets", "huge-ps")  # a warning, not a refusal


def test_ttl_deletes_a_finished_job_and_its_children(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, chiefs, _ = cluster
    apply(kube, new_job("ttl", runPolicy={"ttlSecondsAfterFinished": 1}))
    wait(kube, "v1/configmaps", "ttl-config")
    _, chief = chiefs.of("ttl")
    chief.finished.labels(reason="TargetAccuracyReached", outcome="Succeeded").set(1)
    wait(kube, JOBS, "ttl", lambda j: j is None)
    for resource, pattern in CHILDREN:
        wait(kube, resource, pattern.format("ttl"), lambda o: o is None)


def test_deleting_the_job_takes_its_children(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    kube, _, _ = cluster
    apply(kube, new_job("gone"))
    wait(kube, "apps/v1/deployments", "gone-worker")
    if HAVE_KUBECTL:
        done = user(kube, "delete", "dbj", "gone", "--wait=false")
        assert done.returncode == 0, done.stderr
    else:
        kube.delete(JOBS, "gone")
    for resource, pattern in CHILDREN:
        wait(kube, resource, pattern.format("gone"), lambda o: o is None)


def test_an_invalid_job_is_refused_by_the_api_naming_the_field(cluster: tuple[KubeEmulator, Chiefs, Operator]) -> None:
    if not HAVE_KUBECTL:
        pytest.skip("kubectl not installed (tools/fetch-kube-tools fetches it)")
    kube, _, _ = cluster
    doc = new_job("invalid", training={"batchSize": 0})
    done = user(kube, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(doc))
    assert done.returncode != 0
    assert "spec.training.batchSize" in done.stderr


def test_an_operator_restarted_mid_reconcile_makes_no_duplicates(tmp_path: Path) -> None:
    kube = project_emulator().start()
    kube.write_kubeconfig(tmp_path / "kubeconfig")
    chiefs = Chiefs()
    try:
        first = Operator(kube, chiefs, tmp_path / "first.log").start()
        apply(kube, new_job("restart"))
        wait(kube, "v1/configmaps", "restart-config")  # the first children are being written
        first.stop(signal.SIGKILL)
        second = Operator(kube, chiefs, tmp_path / "second.log").start()
        try:
            wait(kube, "apps/v1/deployments", "restart-worker")
            wait(kube, JOBS, "restart", phase_is("Pending"))
            kubelet_ready(kube, "restart", shards=2, workers=3)
            wait(kube, JOBS, "restart", phase_is("Running"))
        finally:
            second.stop()
        selector = {"distbelief.io/job": "restart"}
        for resource, _ in CHILDREN:
            assert len(kube.list(resource, "default", labels=selector)) == 1, resource
    finally:
        kube.stop()
        chiefs.server.shutdown()


def test_a_missing_peering_object_is_warned_about_then_and_again(tmp_path: Path) -> None:
    kube = project_emulator().start()
    kube.write_kubeconfig(tmp_path / "kubeconfig")
    log_path = tmp_path / "operator.log"
    env = kube.env(DISTBELIEF_PEERING_CHECK_SECONDS="1")
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "distbelief.operator.cli", "operator", "--namespace",
                                    "default", "--liveness", ""], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline and log_path.read_text().count("event=peering_missing") < 2:
            time.sleep(0.2)
        warnings = [line for line in log_path.read_text().splitlines() if "event=peering_missing" in line]
        kube.create("kopf.dev/v1/kopfpeerings", {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
                                                 "metadata": {"name": "distbelief", "namespace": "default"}})
        time.sleep(1.5)  # one check may have been under way
        settled = log_path.read_text().count("event=peering_missing")
        time.sleep(3)  # three more checks: none may warn now
        after = log_path.read_text().count("event=peering_missing") - settled
        failures = log_path.read_text().count("event=peering_check_failed")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        kube.stop()
    assert len(warnings) >= 2, log_path.read_text()[-3000:]
    assert " WARNING " in warnings[0]
    assert "KopfPeering default/distbelief" in warnings[0] and "--standalone" in warnings[0]
    assert after == 0 and failures == 0
