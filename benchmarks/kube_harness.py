"""The operator benchmarks' cluster: the real control plane, KWOK's fake nodes, the operator
as a local process, stand-ins for the jobs' chiefs, and what is measured around them.

    with Stack() as stack:                       # stops everything it started, on any exit
        plane = stack.start(ControlPlane(folder, audited=OPERATOR_USER))
        api = plane.api()
        install_crd(api)
        kwok = stack.start(Kwok(plane, folder)); kwok.add_nodes(api, 10)
        chiefs = stack.start(Chiefs())
        operator = stack.start(Operator(plane, folder, chiefs.url))

- ControlPlane runs ../shared/kube/control-plane (etcd, kube-apiserver 1.36, controller-
  manager, scheduler) with the controllers' and the scheduler's client rate limits raised
  (the defaults, 20 and 50 requests/s, would make the harness, not the operator, the slow
  part at 10,000 pods) and an audit log of one user's requests: the operator's.
- Kwok runs `kwok` (tools/fetch-go-tools kwok) with its default stages: it heartbeats the
  nodes annotated kwok.x-k8s.io/node=fake and makes every pod bound to one Running and Ready.
- Operator runs `distbelief operator` from the project's venv as a ServiceAccount bound to
  cluster-admin: the rights of the admin kubeconfig, but a user of its own, so the audit log
  and the API server's priority-and-fairness metrics (flow schema service-accounts) tell its
  requests from the controllers' and the benchmark's own (system:masters, exempt).
- Chiefs answers every job's chief metrics (DISTBELIEF_METRICS_URL): a global step that
  grows with time, and the job's end once finish() is called for it.
- Watch follows a collection (list, then watch from its resourceVersion) in a thread and hands
  each event with its arrival time to a callback; AuditTail counts the operator's requests;
  Sampler reads processes' RSS and CPU from /proc; histogram_quantile() reads the API server's
  histograms.

Every process is started in a session of its own and asked to die with the benchmark
(PR_SET_PDEATHSIG), so not even a SIGKILL of the benchmark leaves one behind.
"""
from __future__ import annotations

import array
import collections
import ctypes
import datetime
import functools
import http.client
import json
import math
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from distbelief.runtime import contract

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "kube" / "control-plane"
CRD = REPO / "crds" / "distbelief.io_distbeliefjobs.yaml"
JOBS = "distbelief.io/v1alpha1/distbeliefjobs"
OPERATOR_NAMESPACE, OPERATOR_ACCOUNT = "distbelief-system", "distbelief-operator"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"
FAKE_NODE = "kwok.x-k8s.io/node"
# The controllers' and the scheduler's client rate limits, and the controllers' workers.
KCM_ARGS = ("--kube-api-qps=400 --kube-api-burst=800 --concurrent-deployment-syncs=10 "
            "--concurrent-replicaset-syncs=10 --concurrent-statefulset-syncs=10 --concurrent-gc-syncs=40")
SCHEDULER_ARGS = "--kube-api-qps=400 --kube-api-burst=800"
READY_SECONDS = 120.0


class HarnessError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- processes

def _die_with_parent() -> None:
    """In the child, before exec: a session of its own (Ctrl-C reaches only the benchmark,
    which stops it in order), and SIGTERM when the benchmark's process ends, however it ends."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)


def stop(process: subprocess.Popen[bytes] | None, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL after timeout seconds."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Stack:
    """Starts parts and stops them in reverse order when the block ends: normally, on an
    exception, on Ctrl-C, or on SIGTERM (turned into SystemExit while the block runs)."""

    def __init__(self) -> None:
        self.parts: list[Any] = []

    def start(self, part: Any) -> Any:
        self.parts.append(part)
        part.start()
        return part

    def __enter__(self) -> "Stack":
        # Ctrl-C too when started where SIGINT is ignored (a background job of a script)
        self._previous = {sig: signal.signal(sig, handler) for sig, handler in (
            (signal.SIGTERM, self._terminate), (signal.SIGINT, signal.default_int_handler))}
        return self

    @staticmethod
    def _terminate(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None and not issubclass(kind, Exception):
            print(f"interrupted ({kind.__name__}): stopping what was started", file=sys.stderr, flush=True)
        while self.parts:
            part = self.parts.pop()
            try:
                part.stop()
            except Exception as exc:  # keep stopping the rest
                print(f"stopping {type(part).__name__}: {exc}", file=sys.stderr)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def wait_until(what: str, condition: Callable[[], Any], timeout: float, interval: float = 0.2,
               alive: Callable[[], None] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = condition()
        except (OSError, http.client.HTTPException, ApiError):
            result = None
        if result:
            return result
        if alive:
            alive()
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# ----------------------------------------------------------------------------- the API

class ApiError(Exception):
    def __init__(self, code: int, body: str) -> None:
        super().__init__(f"{code}: {body[:300]}")
        self.code, self.body = code, body


def path_of(resource: str, namespace: str | None = None, name: str | None = None, subresource: str | None = None,
            ) -> str:
    """"v1/pods", "apps/v1/statefulsets" or "distbelief.io/v1alpha1/distbeliefjobs" as a path."""
    *group_version, plural = resource.split("/")
    base = "/api/" + group_version[0] if len(group_version) == 1 else "/apis/" + "/".join(group_version)
    parts = [base] + ([f"namespaces/{namespace}"] if namespace else []) + [plural]
    return "/".join(parts + ([name] if name else []) + ([subresource] if subresource else []))


class Api:
    """JSON over HTTPS with one kept-alive connection per thread (a TLS handshake per
    request would cost the API server more than the request)."""

    def __init__(self, server: str, token: str, cafile: Path) -> None:
        target = urllib.parse.urlsplit(server)
        self.host, self.port = target.hostname or "127.0.0.1", target.port or 443
        self.token = token
        self.context = ssl.create_default_context(cafile=str(cafile))
        self.local = threading.local()

    def connection(self, timeout: float | None = 60) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=timeout)

    def headers(self, content_type: str = "application/json") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", "Content-Type": content_type, "Accept": "application/json",
                "User-Agent": "distbelief-benchmark"}

    def raw(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
            query: dict[str, str] | None = None) -> tuple[int, bytes]:
        url = path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        for attempt in range(2):
            conn = getattr(self.local, "conn", None) or self.connection()
            self.local.conn = conn
            try:
                conn.request(method, url, body=data, headers=self.headers(content_type))
                response = conn.getresponse()
                return response.status, response.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                query: dict[str, str] | None = None) -> Any:
        status, data = self.raw(method, path, body, content_type, query)
        if not 200 <= status < 300:
            raise ApiError(status, data.decode(errors="replace"))
        return json.loads(data) if data else None

    def get(self, resource: str, namespace: str | None, name: str) -> Any:
        try:
            return self.request("GET", path_of(resource, namespace, name))
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise

    def list(self, resource: str, namespace: str | None = None, selector: str = "") -> dict[str, Any]:
        return self.request("GET", path_of(resource, namespace), query={"labelSelector": selector} if selector else None)

    def create(self, resource: str, namespace: str | None, body: Any, exist_ok: bool = False) -> Any:
        try:
            return self.request("POST", path_of(resource, namespace), body)
        except ApiError as exc:
            if exist_ok and exc.code == 409:
                return None
            raise

    def patch(self, resource: str, namespace: str | None, name: str, patch: Any, subresource: str | None = None,
              ) -> Any:
        return self.request("PATCH", path_of(resource, namespace, name, subresource), patch,
                            content_type="application/merge-patch+json")

    def delete(self, resource: str, namespace: str | None, name: str) -> None:
        try:
            self.request("DELETE", path_of(resource, namespace, name), {"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.code != 404:
                raise

    def text(self, path: str) -> str:
        status, data = self.raw("GET", path)
        if status != 200:
            raise ApiError(status, data.decode(errors="replace"))
        return data.decode(errors="replace")


# ----------------------------------------------------------------------------- the control plane

AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users: {users}
  - level: None
"""


class ControlPlane:
    """../shared/kube/control-plane DIR as a child process; audited: the users whose every
    request goes to the audit log (DIR/logs/audit.log)."""

    def __init__(self, folder: Path, audited: Iterable[str] = (OPERATOR_USER,)) -> None:
        self.dir = folder / "control-plane"
        self.audited = list(audited)
        self.audit_log = self.dir / "logs" / "audit.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.server = self.token = ""

    def start(self) -> None:
        if not SHARED.exists():
            raise HarnessError(f"no control plane: {SHARED} is missing (../shared/kube beside the repository)")
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        policy = self.dir.parent / "audit-policy.yaml"
        policy.write_text(AUDIT_POLICY.format(users=json.dumps(self.audited)))
        env = {**os.environ,
               "EXTRA_APISERVER_ARGS": f"--audit-policy-file={policy} --audit-log-path={self.audit_log} "
                                       "--audit-log-format=json --audit-log-mode=blocking",
               "EXTRA_KCM_ARGS": KCM_ARGS, "EXTRA_SCHEDULER_ARGS": SCHEDULER_ARGS}
        self.process = spawn([str(SHARED), str(self.dir)], self.dir.parent / "control-plane.log", env)
        wait_until("the control plane", lambda: (self.dir / "READY").exists(), READY_SECONDS, alive=self._alive)
        values = dict(line.split("=", 1) for line in (self.dir / "endpoints.env").read_text().splitlines() if "=" in line)
        self.server, self.token = values["APISERVER_URL"], values["ADMIN_TOKEN"]

    def _alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            log = (self.dir.parent / "control-plane.log").read_text(errors="replace")[-3000:]
            raise HarnessError(f"the control plane exited ({self.process.returncode}):\n{log}")

    def stop(self) -> None:
        stop(self.process, timeout=30)

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def ca(self) -> Path:
        return self.dir / "certs" / "apiserver.crt"

    def api(self, token: str | None = None) -> Api:
        return Api(self.server, token or self.token, self.ca)

    def pids(self) -> dict[str, int]:
        """The components' process ids, by name."""
        found = {}
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            pid_file = self.dir / f"{name}.pid"
            if pid_file.exists():
                found[name] = int(pid_file.read_text())
        return found


def install_crd(api: Api) -> None:
    crd = yaml.safe_load(CRD.read_text())
    api.create("apiextensions.k8s.io/v1/customresourcedefinitions", None, crd, exist_ok=True)
    name = crd["metadata"]["name"]

    def established() -> bool:
        got = api.get("apiextensions.k8s.io/v1/customresourcedefinitions", None, name) or {}
        return any(c["type"] == "Established" and c["status"] == "True"
                   for c in (got.get("status") or {}).get("conditions") or [])

    wait_until(f"CRD {name} established", established, 60)
    # The API server serves the new resource a moment after Established.
    wait_until("the jobs' resource", lambda: api.list(JOBS) is not None, 30)


def ensure_namespace(api: Api, name: str) -> None:
    api.create("v1/namespaces", None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
               exist_ok=True)


# ----------------------------------------------------------------------------- KWOK

def kwok_binary() -> str:
    done = subprocess.run([str(REPO / "tools" / "fetch-go-tools"), "kwok"], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise HarnessError(f"tools/fetch-go-tools kwok failed: {done.stderr.strip()[-2000:]}")
    return str(Path(done.stdout.strip().splitlines()[-1]) / "kwok")


class Kwok:
    """`kwok` with its default node and pod stages (no stage given: node-initialize and
    node-heartbeat, pod-ready, pod-complete, pod-delete), managing the nodes annotated
    kwok.x-k8s.io/node=fake, with leases like a kubelet's."""

    def __init__(self, plane: ControlPlane, folder: Path) -> None:
        self.plane, self.folder = plane, folder
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = spawn([kwok_binary(), f"--kubeconfig={self.plane.kubeconfig}",
                              f"--manage-nodes-with-annotation-selector={FAKE_NODE}=fake",
                              "--cidr=10.0.0.1/16", "--node-lease-duration-seconds=40", "-v=WARN"],
                             self.folder / "kwok.log")

    def stop(self) -> None:
        stop(self.process)

    def add_nodes(self, api: Api, count: int, cpu: str = "128", memory: str = "512Gi", pods: int = 250) -> None:
        """count fake nodes, each with that capacity; back once every one is Ready."""
        capacity = {"cpu": cpu, "memory": memory, "pods": str(pods)}
        for i in range(count):
            name = f"kwok-node-{i:04d}"
            api.create("v1/nodes", None, {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "annotations": {FAKE_NODE: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                             "labels": {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}},
                "status": {"allocatable": capacity, "capacity": capacity}}, exist_ok=True)

        def ready() -> bool:
            nodes = api.list("v1/nodes", selector="type=kwok")["items"]
            return len(nodes) >= count and all(
                any(c["type"] == "Ready" and c["status"] == "True" for c in (n.get("status") or {}).get("conditions") or [])
                for n in nodes)

        wait_until(f"{count} fake nodes Ready", ready, 120, interval=0.5, alive=self._alive)

    def _alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise HarnessError(f"kwok exited ({self.process.returncode}):\n"
                               f"{(self.folder / 'kwok.log').read_text(errors='replace')[-3000:]}")


def claim_volumes(api: Api, claims: Iterable[tuple[str, str]]) -> int:
    """A PersistentVolume bound ahead to each (namespace, claim): nothing provisions volumes
    here, and a pod whose claim stays unbound is never scheduled. The controller-manager
    binds each claim to its volume when the claim appears."""
    made = 0
    for namespace, claim in claims:
        api.create("v1/persistentvolumes", None, {
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": f"pv-{namespace}-{claim}"[:253], "labels": {"type": "kwok"}},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                     "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": "/nonexistent"},
                     "claimRef": {"namespace": namespace, "name": claim}}}, exist_ok=True)
        made += 1
    return made


# ----------------------------------------------------------------------------- the operator

class Operator:
    """`distbelief operator` (clusterwide, standalone, its own metrics on a loopback port)
    as the ServiceAccount distbelief-system/distbelief-operator, bound to cluster-admin."""

    def __init__(self, plane: ControlPlane, folder: Path, metrics_url: str, *, namespaces: Iterable[str] = (),
                 status_interval: float | None = None, env: dict[str, str] | None = None) -> None:
        self.plane, self.folder, self.metrics_url = plane, folder, metrics_url
        self.namespaces, self.status_interval, self.extra_env = list(namespaces), status_interval, env or {}
        self.liveness_port, self.metrics_port = free_port(), free_port()
        self.log = folder / "operator.log"
        self.kubeconfig = folder / "operator.kubeconfig"
        self.process: subprocess.Popen[bytes] | None = None

    def identity(self) -> None:
        api = self.plane.api()
        ensure_namespace(api, OPERATOR_NAMESPACE)
        api.create("v1/serviceaccounts", OPERATOR_NAMESPACE, {
            "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": OPERATOR_ACCOUNT}}, exist_ok=True)
        api.create("rbac.authorization.k8s.io/v1/clusterrolebindings", None, {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "distbelief-operator-bench"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_ACCOUNT, "namespace": OPERATOR_NAMESPACE}]},
            exist_ok=True)
        token = api.request("POST", path_of("v1/serviceaccounts", OPERATOR_NAMESPACE, OPERATOR_ACCOUNT, "token"),
                            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                             "spec": {"expirationSeconds": 12 * 3600}})["status"]["token"]
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "operator",
            "clusters": [{"name": "local", "cluster": {"server": self.plane.server,
                                                       "certificate-authority": str(self.plane.ca)}}],
            "users": [{"name": "operator", "user": {"token": token}}],
            "contexts": [{"name": "operator", "context": {"cluster": "local", "user": "operator"}}]}))
        self.kubeconfig.chmod(0o600)

    def command(self) -> list[str]:
        # The venv's own interpreter: what `distbelief` runs, wherever the venv was copied to
        return [sys.executable, "-m", "distbelief.operator.cli", "--log-level=info", "operator", "--standalone",
                f"--liveness=http://127.0.0.1:{self.liveness_port}/healthz",
                f"--metrics=127.0.0.1:{self.metrics_port}", *[f"--namespace={n}" for n in self.namespaces]]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "DISTBELIEF_"))}
        env.update(KUBECONFIG=str(self.kubeconfig), POD_ID="distbelief-operator-bench",
                   DISTBELIEF_OPERATOR_NAMESPACE=OPERATOR_NAMESPACE, DISTBELIEF_METRICS_URL=self.metrics_url)
        if self.status_interval is not None:
            env["DISTBELIEF_STATUS_INTERVAL"] = str(self.status_interval)
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        if not self.kubeconfig.exists():
            self.identity()
        self.process = spawn(self.command(), self.log, self.environment())

        def live() -> bool:
            with socket.create_connection(("127.0.0.1", self.liveness_port), timeout=2) as sock:
                sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
                return sock.recv(64).startswith(b"HTTP/1.")

        wait_until("the operator's liveness endpoint", live, 60, alive=self.alive)

    def alive(self) -> None:
        if self.process is None or self.process.poll() is not None:
            code = None if self.process is None else self.process.returncode
            raise HarnessError(f"the operator exited ({code}):\n{self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        stop(self.process)

    def own_metrics(self) -> str:
        with socket.create_connection(("127.0.0.1", self.metrics_port), timeout=5) as sock:
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            data = b"".join(iter(lambda: sock.recv(65536), b""))
        return data.split(b"\r\n\r\n", 1)[-1].decode(errors="replace")

    def throttled_lines(self) -> int:
        """kopf's own throttling: after an unexpected error in a handler, kopf stops
        processing for a while and logs "Throttling for N seconds"."""
        if not self.log.exists():
            return 0
        with open(self.log, "rb") as log:
            return sum(line.count(b"Throttling for") for line in log)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the chiefs

@dataclass
class Chief:
    started: float
    finished_at: float | None = None
    scrapes: int = 0
    last_scrape: float | None = None


class Chiefs:
    """Shard 0's /metrics of every job at /<namespace>/<job>/metrics, answered from this
    process for any job: the step grows at STEPS_PER_SECOND from the first scrape, and after
    finish(namespace, job) the chief reports the job Succeeded. Each job's scrape intervals
    are kept (the operator's status passes, as the chief sees them)."""

    STEPS_PER_SECOND = 50.0

    def __init__(self) -> None:
        self.chiefs: dict[tuple[str, str], Chief] = {}
        self.intervals: list[float] = []
        self.lock = threading.Lock()
        self.server: socket.socket | None = None
        self.url = ""
        self.threads: list[threading.Thread] = []
        self.stopping = threading.Event()

    def start(self) -> None:
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(512)
        self.server.settimeout(0.5)
        port = self.server.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/{{namespace}}/{{job}}/metrics"
        for _ in range(4):
            thread = threading.Thread(target=self._serve, daemon=True)
            thread.start()
            self.threads.append(thread)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=5)
        if self.server is not None:
            self.server.close()

    def finish(self, namespace: str, job: str) -> float:
        now = time.monotonic()
        with self.lock:
            self.chiefs.setdefault((namespace, job), Chief(now)).finished_at = now
        return now

    def body(self, namespace: str, job: str) -> bytes:
        now = time.monotonic()
        with self.lock:
            chief = self.chiefs.setdefault((namespace, job), Chief(now))
            if chief.last_scrape is not None:
                self.intervals.append(now - chief.last_scrape)
            chief.last_scrape, chief.scrapes = now, chief.scrapes + 1
            end = chief.finished_at
        step = int(((end or now) - chief.started) * self.STEPS_PER_SECOND)
        lines = ["# TYPE distbelief_global_step gauge", f"distbelief_global_step {step}",
                 "# TYPE distbelief_examples_per_second gauge",
                 f"distbelief_examples_per_second {self.STEPS_PER_SECOND * 32:.1f}",
                 "# TYPE distbelief_heldout_accuracy gauge", f"distbelief_heldout_accuracy {min(0.99, step / 1e5):.4f}",
                 "# TYPE distbelief_heldout_loss gauge", f"distbelief_heldout_loss {1 / (1 + step / 1e3):.4f}"]
        if end is not None:
            lines += ["# TYPE distbelief_job_finished gauge",
                      'distbelief_job_finished{outcome="Succeeded",reason="MaxStepsReached"} 1']
        return ("\n".join(lines) + "\n").encode()

    def _serve(self) -> None:
        assert self.server is not None
        while not self.stopping.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5)
                    head = b""
                    while b"\r\n\r\n" not in head and len(head) < 8192:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        head += chunk
                    parts = head.split(b" ", 2)[1].decode().strip("/").split("/") if b" " in head else []
                    if len(parts) == 3 and parts[2] == "metrics":
                        body, status = self.body(parts[0], parts[1]), b"200 OK"
                    else:
                        body, status = b"", b"404 Not Found"
                    conn.sendall(b"HTTP/1.0 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
                                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                except OSError:
                    pass


# ----------------------------------------------------------------------------- watching

class Watch(threading.Thread):
    """Follow resource (in every namespace, or one) from a list: on_event(type, object,
    arrival time) for each item of the list (as ADDED) and each event after it. Resumes
    after the server closes the watch; lists again after 410 Gone."""

    def __init__(self, api: Api, resource: str, on_event: Callable[[str, dict, float], None], *,
                 namespace: str | None = None, selector: str = "") -> None:
        super().__init__(daemon=True, name=f"watch {resource}")
        self.api, self.resource, self.on_event = api, resource, on_event
        self.namespace, self.selector = namespace, selector
        self.stopping = threading.Event()
        self.conn: http.client.HTTPSConnection | None = None
        self.listed = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by check()
            if not self.stopping.is_set():
                self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise HarnessError(f"the watch of {self.resource} failed: {self.error!r}")

    def _list(self) -> str:
        listed = self.api.list(self.resource, self.namespace, self.selector)
        now = time.monotonic()
        for item in listed["items"]:
            self.on_event("ADDED", item, now)
        self.listed.set()
        return listed["metadata"]["resourceVersion"]

    def _run(self) -> None:
        version = self._list()
        while not self.stopping.is_set():
            query = {"watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true", "timeoutSeconds": "240"}
            if self.selector:
                query["labelSelector"] = self.selector
            self.conn = self.api.connection(timeout=300)
            try:
                self.conn.request("GET", path_of(self.resource, self.namespace) + "?" + urllib.parse.urlencode(query),
                                  headers=self.api.headers())
                response = self.conn.getresponse()
                if response.status != 200:
                    raise ApiError(response.status, response.read().decode(errors="replace"))
                while not self.stopping.is_set():
                    line = response.readline()
                    if not line:
                        break
                    event = json.loads(line)
                    now = time.monotonic()
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            version = self._list()
                            break
                        raise ApiError(obj.get("code", 0), json.dumps(obj))
                    version = obj["metadata"]["resourceVersion"]
                    if kind != "BOOKMARK":
                        self.on_event(kind, obj, now)
            except (OSError, http.client.HTTPException):
                if self.stopping.is_set():
                    return
                time.sleep(0.2)
            finally:
                self.conn.close()

    def stop(self) -> None:
        self.stopping.set()
        conn = self.conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.join(timeout=5)

    def start(self) -> None:  # type: ignore[override]
        super().start()
        if not self.listed.wait(60):
            raise HarnessError(f"the first list of {self.resource} did not come")


# ----------------------------------------------------------------------------- a job's children

MANAGED = "app.kubernetes.io/managed-by=distbelief-operator"   # the label of every child
CHILD_KINDS = {"v1/configmaps": "ConfigMap", "v1/services": "Service", "v1/secrets": "Secret",
               "apps/v1/statefulsets": "StatefulSet", "apps/v1/deployments": "Deployment",
               "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
               "networking.k8s.io/v1/networkpolicies": "NetworkPolicy"}


def child_suffixes(job: dict[str, Any]) -> list[str]:
    """"Kind/-suffix" of every child the operator makes for job, its keys Secret included:
    each child's kind and name less the job's (rendered here as the operator renders it)."""
    from distbelief.operator.render import context, render
    from distbelief.operator.validation import spec

    name = job["metadata"]["name"]
    valid: Any = spec.validate_job(job)
    try:  # the renderer takes the typed job since the operator reads it (and a dict before)
        from distbelief.operator.validation.job import DistBeliefJob
    except ImportError:
        pass
    else:
        valid = DistBeliefJob.of(valid)
    children = render.render_children(valid, image=context.DEFAULT_IMAGE, operator_namespace=OPERATOR_NAMESPACE)
    names = [(c["kind"], c["metadata"]["name"]) for c in children] + [("Secret", contract.JobNames(name).keys_secret)]
    return [f"{kind}/{child[len(name):]}" for kind, child in names]


class ChildrenSeen:
    """When each job's children were first seen (monotonic seconds), by (namespace, job):
    fed by watches() of every kind of child; complete[job] once all of suffixes were seen.
    Subclasses follow more in seen(), called under the lock for every event."""

    def __init__(self, suffixes: list[str]) -> None:
        self.suffixes = suffixes
        self.lock = threading.Lock()
        self.children: dict[tuple[str, str], dict[str, float]] = collections.defaultdict(dict)
        self.complete: dict[tuple[str, str], float] = {}
        self.events: collections.Counter[str] = collections.Counter()

    def watches(self, api: Api, namespace: str | None = None) -> list[Watch]:
        return [Watch(api, resource, functools.partial(self.on_child, kind), namespace=namespace, selector=MANAGED)
                for resource, kind in CHILD_KINDS.items()]

    def on_child(self, kind: str, event: str, obj: dict[str, Any], now: float) -> None:
        meta = obj["metadata"]
        job = (meta.get("labels") or {}).get(contract.LABEL_JOB)
        if job is None or event == "DELETED":
            return
        key = (meta["namespace"], job)
        child = f"{kind}/{meta['name'][len(job):]}"
        with self.lock:
            self.events[kind] += 1
            seen = self.children[key]
            if child not in seen:
                seen[child] = now
                if key not in self.complete and all(s in seen for s in self.suffixes):
                    self.complete[key] = now
            self.seen(kind, key, obj, now)

    def seen(self, kind: str, key: tuple[str, str], obj: dict[str, Any], now: float) -> None:
        pass


# ----------------------------------------------------------------------------- the audit log

def _epoch(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class AuditTail:
    """The audited user's requests, read from the audit log as it grows (read() from time to
    time, a chunk at a time): when each came in (the wall clock) and its verb and resource;
    and each finished request's time in the API server."""

    CHUNK = 8 << 20

    def __init__(self, path: Path, user: str = OPERATOR_USER) -> None:
        self.path, self.user = path, user
        self.offset = 0
        self.names: dict[str, int] = {}                   # "verb resource[/subresource]" -> index
        self.at, self.what = array.array("d"), array.array("H")   # each request: when it came, what
        self.received, self.seconds = array.array("d"), array.array("d")   # finished requests
        self.lock = threading.Lock()

    def read(self) -> None:
        with self.lock:
            try:
                log = open(self.path, "rb")
            except FileNotFoundError:
                return
            with log:
                while True:
                    log.seek(self.offset)
                    data = log.read(self.CHUNK)
                    complete = data[:data.rfind(b"\n") + 1]
                    if not complete:
                        return
                    self.offset += len(complete)
                    for line in complete.splitlines():
                        self._count(json.loads(line))

    def _count(self, event: dict[str, Any]) -> None:
        if event["user"]["username"] != self.user:
            return
        verb, stage = event["verb"], event["stage"]
        if stage == "ResponseComplete" and verb == "watch":
            return  # counted when it started
        ref = event.get("objectRef") or {}
        what = f"{verb} {ref.get('resource', '')}" + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        received = _epoch(event["requestReceivedTimestamp"])
        self.at.append(received)
        self.what.append(self.names.setdefault(what, len(self.names)))
        if stage == "ResponseComplete":
            self.received.append(received)
            self.seconds.append(_epoch(event["stageTimestamp"]) - received)

    def window(self, start: float, end: float) -> collections.Counter[str]:
        """Requests received in [start, end) of the wall clock, by verb and resource."""
        self.read()
        with self.lock:
            names = {index: name for name, index in self.names.items()}
            return collections.Counter(names[w] for t, w in zip(self.at, self.what) if start <= t < end)

    def latency_quantiles(self, start: float, end: float) -> dict[str, float | None]:
        with self.lock:
            values = sorted(s for t, s in zip(self.received, self.seconds) if start <= t < end)
        return {"p50": quantile(values, 0.5), "p99": quantile(values, 0.99), "max": values[-1] if values else None}


# ----------------------------------------------------------------------------- processes' figures

TICKS = os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU seconds the whole machine has spent busy (every core, every process), from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / TICKS


def proc_figures(pid: int) -> tuple[float, int] | None:
    """(CPU seconds so far, resident bytes) of a process; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    cpu = (int(fields[11]) + int(fields[12])) / TICKS
    rss = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return cpu, rss


@dataclass
class Sampler:
    """Every process's CPU seconds and RSS once a second, by name (in a thread); "machine":
    the busy CPU seconds of the whole machine, whose other work the figures are taken beside."""

    pids: dict[str, int]
    interval: float = 1.0
    samples: dict[str, list[tuple[float, float, int]]] = field(default_factory=lambda: collections.defaultdict(list))

    def __post_init__(self) -> None:
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stopping.is_set():
            now = time.monotonic()
            for name, pid in list(self.pids.items()):
                got = proc_figures(pid)
                if got:
                    self.samples[name].append((now, *got))
            self.samples["machine"].append((now, machine_busy(), 0))
            self.stopping.wait(self.interval)

    def summary(self, name: str, start: float = 0.0, end: float = math.inf) -> dict[str, float | None]:
        """Peak RSS (MiB) and mean CPU (cores) of name between start and end (monotonic)."""
        inside = [s for s in self.samples.get(name, []) if start <= s[0] <= end]
        if len(inside) < 2:
            return {"rss_peak_mib": None, "cpu_cores": None, "cpu_seconds": None}
        seconds = inside[-1][1] - inside[0][1]
        return {"rss_peak_mib": max(s[2] for s in inside) / 2**20, "cpu_cores": seconds / (inside[-1][0] - inside[0][0]),
                "cpu_seconds": seconds}


# ----------------------------------------------------------------------------- figures

def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile of sorted values (nearest rank); None for none."""
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def spread(values: Iterable[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {"count": len(ordered), "p50": quantile(ordered, 0.5), "p99": quantile(ordered, 0.99),
            "max": ordered[-1] if ordered else None}


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str, names: Iterable[str]) -> list[tuple[str, dict[str, str], float]]:
    """The samples of the metrics whose name starts with one of names, from Prometheus text."""
    prefixes = tuple(names)
    found = []
    for line in text.splitlines():
        if not line.startswith(prefixes):
            continue
        match = SAMPLE.match(line)
        if match:
            found.append((match[1], dict(LABEL.findall(match[2] or "")), float(match[3])))
    return found


def histogram(text: str, name: str, keep: Callable[[dict[str, str]], bool] = lambda labels: True,
              ) -> dict[float, float]:
    """The histogram's cumulative bucket counts (upper bound -> count), summed over every
    series whose labels keep() accepts."""
    buckets: dict[float, float] = collections.defaultdict(float)
    for metric, labels, value in samples(text, [name + "_bucket"]):
        if metric == name + "_bucket" and keep(labels):
            buckets[float(labels["le"])] += value
    return dict(buckets)


def histogram_delta(after: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    return {le: count - before.get(le, 0.0) for le, count in after.items()}


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """As PromQL's histogram_quantile: linear within the bucket that holds the rank."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = bound, count
    return lower


def over(buckets: dict[float, float], seconds: float) -> float:
    """How many observations of the histogram were above seconds (bucket bounds permitting)."""
    bounds = sorted(buckets)
    if not bounds:
        return 0.0
    at = max((b for b in bounds if b <= seconds), default=None)
    return buckets[bounds[-1]] - (buckets[at] if at is not None else 0.0)


def counter_sum(text: str, name: str, keep: Callable[[dict[str, str]], bool] = lambda labels: True) -> float:
    return sum(value for metric, labels, value in samples(text, [name]) if metric == name and keep(labels))
