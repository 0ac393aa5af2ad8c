"""pytest fixtures of the cluster tier: one real control plane per session, a namespace per test.

    control_plane   the started ControlPlane (session-scoped), its CRD and chart not installed
    kubectl         run kubectl against it: kubectl("get", "pods", "-n", ns) -> stdout
    api             the API as the cluster's admin, from Python: get, create, patch, delete, wait
    namespace       a fresh namespace for one test, deleted after it
    chart           the Helm chart installed with the real helm (session-scoped): its namespace
    operator        `distbelief operator` as a local process, as the chart's ServiceAccount with
                    exactly the chart's RBAC (session-scoped process; operator.restart());
                    a test using it fails if the server refused the operator any request
                    meanwhile (the API server's audit log tells)
    chiefs          the jobs' shard-0 metrics the operator reads (support/chiefs.py)

Without the binaries, kubectl or helm the tests that use these skip with one line saying
how to get them; under CI=true they fail instead, so CI never passes by skipping them.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from support import controlplane
from support.chiefs import Chiefs
from support.paths import REPO
from support.ports import free_port

CHART = REPO / "charts" / "distbelief"
RELEASE, RELEASE_NAMESPACE = "distbelief", "distbelief-system"
CRD_NAME = "distbeliefjobs.distbelief.io"
JOBS = "distbelief.io/v1alpha1/distbeliefjobs"
# How long a test waits for the operator (or a controller) to act: generous, because the
# machine is shared; a wait ends as soon as its condition holds.
WAIT = 45.0


class Kubectl:
    def __init__(self, plane: controlplane.ControlPlane, binary: str, *args: str) -> None:
        self.plane, self.binary, self.args = plane, binary, args   # args: before every command's own

    def as_user(self, token: str) -> "Kubectl":
        """kubectl authenticated by token instead of as the admin."""
        return Kubectl(self.plane, self.binary, "--token", token)

    def __call__(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        done = self.run(*args, input=input, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def run(self, *args: str, input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.binary, *self.args, *args], input=input, capture_output=True, text=True,
                              env=self.plane.env(), timeout=timeout)

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json"))


def unavailable(reason: str) -> None:
    """Skip for want of a tool (reason says how to get it); fail instead under CI=true, where
    every test must run."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"this test must run under CI=true: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    folder = controlplane.binaries()
    if folder is None:
        unavailable(f"no Kubernetes control plane here: {controlplane.HOW}")
    plane = controlplane.ControlPlane(folder, tmp_path_factory.mktemp("control-plane")).start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kubectl(control_plane: controlplane.ControlPlane) -> Kubectl:
    binary = controlplane.tool("kubectl")
    if binary is None:
        unavailable("no kubectl: `make kube-tools` fetches it")
    return Kubectl(control_plane, binary)


@pytest.fixture(scope="session")
def helm(control_plane: controlplane.ControlPlane) -> Callable[..., str]:
    binary = controlplane.tool("helm")
    if binary is None:
        unavailable("no helm: `make kube-tools` fetches it")

    def run(*args: str, timeout: float = 120) -> str:
        done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout,
                              env=helm_env(control_plane))
        if done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()}")
        return done.stdout

    return run


def helm_env(plane: controlplane.ControlPlane) -> dict[str, str]:
    """helm's environment for the plane: its kubeconfig, and helm's caches in the plane's
    folder (nothing of the user's helm read or written)."""
    home = str(plane.dir / "helm")
    return plane.env(HELM_CACHE_HOME=home, HELM_CONFIG_HOME=home, HELM_DATA_HOME=home)


class ApiError(Exception):
    def __init__(self, code: int, body: str) -> None:
        super().__init__(f"{code}: {body[:500]}")
        self.code, self.body = code, body


class Api:
    """The Kubernetes API as the control plane's admin. Resources are named as
    "v1/configmaps", "apps/v1/statefulsets" or "distbelief.io/v1alpha1/distbeliefjobs"."""

    def __init__(self, plane: controlplane.ControlPlane) -> None:
        self.server, self.token = plane.server, plane.admin_token
        self.context = ssl.create_default_context(cafile=str(plane.dir / "certs" / "apiserver.crt"))

    @staticmethod
    def path(resource: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        *group_version, plural = resource.split("/")
        base = "/api/" + group_version[0] if len(group_version) == 1 else "/apis/" + "/".join(group_version)
        parts = [base] + ([f"namespaces/{namespace}"] if namespace else []) + [plural]
        return "/".join(parts + ([name] if name else []) + ([subresource] if subresource else []))

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                query: dict[str, str] | None = None) -> Any:
        url = self.server + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": content_type, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.context) as response:
                text = response.read()
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")) from None
        return json.loads(text) if text else None

    def get(self, resource: str, namespace: str | None, name: str) -> Any:
        """The object, or None when there is none."""
        try:
            return self.request("GET", self.path(resource, namespace, name))
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise

    def list(self, resource: str, namespace: str | None, selector: str = "") -> list[Any]:
        query = {"labelSelector": selector} if selector else None
        return self.request("GET", self.path(resource, namespace), query=query)["items"]

    def create(self, resource: str, namespace: str | None, body: Any) -> Any:
        return self.request("POST", self.path(resource, namespace), body)

    def patch(self, resource: str, namespace: str | None, name: str, patch: Any, subresource: str | None = None,
              ) -> Any:
        return self.request("PATCH", self.path(resource, namespace, name, subresource), patch,
                            content_type="application/merge-patch+json")

    def delete(self, resource: str, namespace: str | None, name: str, propagation: str = "Background") -> bool:
        """False when there was nothing to delete."""
        try:
            self.request("DELETE", self.path(resource, namespace, name), {"propagationPolicy": propagation})
        except ApiError as exc:
            if exc.code == 404:
                return False
            raise
        return True

    def wait(self, resource: str, namespace: str | None, name: str,
             condition: Callable[[Any], Any] = lambda obj: obj is not None, timeout: float = WAIT) -> Any:
        """The object once condition(object or None) holds; AssertionError naming what was
        last seen when it does not within timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            seen = self.get(resource, namespace, name)
            if condition(seen):
                return seen
            if time.monotonic() > deadline:
                shown = json.dumps(seen, indent=1)[-3000:] if seen is not None else "nothing"
                raise AssertionError(f"{resource} {namespace}/{name} did not reach the condition in {timeout:.0f} s; "
                                     f"last seen:\n{shown}")
            time.sleep(0.2)

    def events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        """The core Events about the object name in namespace, oldest first."""
        found = [e for e in self.list("v1/events", namespace) if e["involvedObject"].get("name") == name]
        return sorted(found, key=lambda e: int(e["metadata"]["resourceVersion"]))  # etcd's order of writes

    def wait_event(self, namespace: str, name: str, reason: str, timeout: float = WAIT) -> dict[str, Any]:
        """The first Event about name with that reason, once there is one (kopf posts Events
        from a queue of its own, so one may land after what it reports)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.events(namespace, name) if e["reason"] == reason]
            if found:
                return found[0]
            if time.monotonic() > deadline:
                reasons = [e["reason"] for e in self.events(namespace, name)]
                raise AssertionError(f"no Event {reason} about {namespace}/{name} in {timeout:.0f} s: {reasons}")
            time.sleep(0.2)


@pytest.fixture(scope="session")
def api(control_plane: controlplane.ControlPlane) -> Api:
    return Api(control_plane)


@pytest.fixture
def namespace(kubectl: Kubectl) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def chart(helm: Callable[..., str], kubectl: Kubectl) -> str:
    """The chart with its default values, installed by the real helm (its crds/ folder brings
    the CRDs): the release's namespace."""
    helm("install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace")
    kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    return RELEASE_NAMESPACE


def stop_process(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Send sig, wait for the end; SIGKILL after timeout seconds."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Operator:
    """`distbelief operator` as a local process, run as the chart's Deployment runs it: its
    arguments and environment, as its ServiceAccount (a token from the TokenRequest API),
    so with exactly the chart's RBAC. Only the liveness port moves to a free loopback port,
    the operator's own metrics are served on another (`metrics_url`; the chart serves them
    with metrics.operator.enabled), the status interval and the retries of a refused job are
    shortened, and the chiefs' metrics are read from `chiefs`.

    It keeps one POD_ID across restarts, as a container restarted in its pod does: kopf
    then knows its own peering entry and does not wait for it to lapse."""

    POD_ID = "distbelief-operator-test"

    def __init__(self, plane: controlplane.ControlPlane, kubectl: Kubectl, namespace: str, chiefs: Chiefs,
                 folder: Path) -> None:
        self.plane, self.chiefs, self.folder = plane, chiefs, folder
        (deployment,) = kubectl.json("get", "deployment", "-n", namespace, "-l",
                                     "app.kubernetes.io/name=distbelief")["items"]
        pod = deployment["spec"]["template"]["spec"]
        (self.container,) = pod["containers"]
        self.user = f"system:serviceaccount:{namespace}:{pod['serviceAccountName']}"
        token = kubectl("create", "token", pod["serviceAccountName"], "-n", namespace, "--duration=12h").strip()
        self.kubeconfig = folder / "operator.kubeconfig"
        ca = (plane.dir / "certs" / "apiserver.crt").read_text()
        (folder / "ca.crt").write_text(ca)
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "operator",
            "clusters": [{"name": "local", "cluster": {"server": plane.server,
                                                       "certificate-authority": str(folder / "ca.crt")}}],
            "users": [{"name": "operator", "user": {"token": token}}],
            "contexts": [{"name": "operator", "context": {"cluster": "local", "user": "operator"}}]}))
        self.kubeconfig.chmod(0o600)
        self.namespace = namespace
        self.liveness = f"http://127.0.0.1:{free_port()}/healthz"
        self.metrics = f"127.0.0.1:{free_port()}"
        self.metrics_url = f"http://{self.metrics}/metrics"
        self.log_path = folder / "operator.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.extra_env: dict[str, str] = {}   # what a test changes in the chart's environment (an upgrade)

    def command(self) -> list[str]:
        args = [f"--liveness={self.liveness}" if a.startswith("--liveness=") else a for a in self.container["args"]
                if not a.startswith("--metrics=")]
        return [str(Path(sys.executable).parent / "distbelief"), *args, f"--metrics={self.metrics}"]

    def environment(self) -> dict[str, str]:
        values = {e["name"]: e["value"] for e in self.container.get("env", []) if "value" in e}
        values.update(POD_ID=self.POD_ID, DISTBELIEF_OPERATOR_NAMESPACE=self.namespace,
                      DISTBELIEF_STATUS_INTERVAL="1", DISTBELIEF_BLOCKED_RETRY_SECONDS="2",
                      DISTBELIEF_METRICS_URL=self.chiefs.url, **self.extra_env)
        return {**{k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "DISTBELIEF_"))},
                **values, "KUBECONFIG": str(self.kubeconfig)}

    def start(self) -> "Operator":
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), env=self.environment(), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + WAIT
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the operator exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.liveness, timeout=2):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the operator did not come up:\n{self.log_tail()}") from None
                time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process:
            stop_process(self.process, sig)

    def restart(self, sig: int = signal.SIGTERM) -> None:
        """Stop it (SIGKILL: without its clean-up) and start it again."""
        self.stop(sig)
        self.start()

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def calls(self, since: int = 0, *, started: bool = False) -> tuple[list[dict[str, Any]], int]:
        """The operator's requests the API server answered, from the audit log (offset since);
        started: the watches under way too."""
        stages = ("ResponseComplete", "ResponseStarted") if started else ("ResponseComplete",)
        return self.plane.audit(self.user, since, stages)


@pytest.fixture(scope="session")
def chiefs() -> Iterator[Chiefs]:
    served = Chiefs()
    yield served
    served.stop()


@pytest.fixture(scope="session")
def operator_process(control_plane: controlplane.ControlPlane, kubectl: Kubectl, chart: str, chiefs: Chiefs,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    if not control_plane.has("kube-controller-manager"):
        unavailable("the operator's tests need kube-controller-manager (pods, garbage collection) beside "
                    f"the API server in {control_plane.bin}")
    running = Operator(control_plane, kubectl, chart, chiefs, tmp_path_factory.mktemp("operator")).start()
    try:
        yield running
    finally:
        running.stop()


def refused(calls: list[dict[str, Any]]) -> list[str]:
    """The requests in calls that RBAC refused (not those refused for other reasons, such as a
    namespace being deleted)."""
    def shown(e: dict[str, Any]) -> str:
        ref = e.get("objectRef") or {}
        resource = ref.get("resource", "") + ("/" + ref["subresource"] if ref.get("subresource") else "")
        group = "." + ref["apiGroup"] if ref.get("apiGroup") else ""
        return f"{e['verb']} {resource}{group} {ref.get('namespace') or '(cluster)'}/{ref.get('name') or '*'}"

    return sorted({shown(e) for e in calls if (e.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid"})


@pytest.fixture
def operator(operator_process: Operator, request: pytest.FixtureRequest) -> Iterator[Operator]:
    """The session's operator; the test fails if the API server refused it anything meanwhile
    (a verb the chart forgets) or if it is not running at the end."""
    _, start = operator_process.calls()
    yield operator_process
    calls, _ = operator_process.calls(start)
    denied = refused(calls)
    if operator_process.process is None or operator_process.process.poll() is not None:
        operator_process.start()
        pytest.fail(f"the operator exited during the test:\n{operator_process.log_tail()}")
    if denied:
        pytest.fail(f"the chart's RBAC refused the operator: {denied}\n{operator_process.log_tail(3000)}")
