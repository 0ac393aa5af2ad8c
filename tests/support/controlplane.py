"""A real Kubernetes control plane on loopback, for the cluster tests.

etcd, kube-apiserver (RBAC on), and, when their binaries are there, kube-controller-
manager and kube-scheduler: what envtest gives Go operators, plus the controllers. There
is no kubelet (tools/local-node runs bound pods). The binaries come from
$KUBEBUILDER_ASSETS (setup-envtest's folder, or any folder holding them), else from
../shared/kube beside the repository (`control-plane --unpack`).

    plane = ControlPlane(binaries(), workdir).start()   # plane.kubeconfig, plane.env()
    plane.stop()

The API server runs as strict clusters do in one respect the defaults leave out: the
OwnerReferencesPermissionEnforcement admission plugin is on (OpenShift enables it), so a
client that sets blockOwnerDeletion must be allowed to update its owner's finalizers. It
also keeps an audit log of every request made by a ServiceAccount (`audit()`), which is
how the tests learn what the operator, running as the chart's ServiceAccount, asked for
and what the server refused it.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from support.paths import REPO
from support.ports import free_ports

SHARED_SCRIPT = REPO.parent / "shared" / "kube" / "control-plane"
REQUIRED = ("etcd", "kube-apiserver")
HOW = ("set KUBEBUILDER_ASSETS to a folder holding etcd and kube-apiserver 1.36 (and kube-controller-manager "
       "and kube-scheduler for the controllers), e.g. `setup-envtest use 1.36 -p path`")
READY_SECONDS = 120.0
# Metadata (who, verb, object, response code) of every request by a ServiceAccount; nothing else.
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
  - level: None
"""


def binaries() -> Path | None:
    """The folder holding the control plane's binaries, or None."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        return Path(assets) if all((Path(assets) / b).exists() for b in REQUIRED) else None
    if SHARED_SCRIPT.exists():
        done = subprocess.run([str(SHARED_SCRIPT), "--unpack"], capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            return Path(done.stdout.strip().splitlines()[-1])
    return None


class ControlPlane:
    """The components as child processes, their state and logs under workdir."""

    def __init__(self, bin_dir: Path, workdir: Path) -> None:
        self.bin, self.dir = bin_dir, workdir
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.arguments: dict[str, tuple[object, ...]] = {}   # each component's, to start it again
        self.admin_token = secrets.token_hex(16)
        self.user_token = secrets.token_hex(16)  # a user with no groups, for RBAC checks
        self.kubeconfig = workdir / "kubeconfig"
        self.audit_log = workdir / "logs" / "audit.log"
        self.server = ""

    def has(self, component: str) -> bool:
        return (self.bin / component).exists()

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), **extra}

    def start(self) -> "ControlPlane":
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        etcd_port, peer_port, api_port, kcm_port, sched_port = free_ports(5)
        self._write_credentials()
        (self.dir / "audit-policy.yaml").write_text(AUDIT_POLICY)
        etcd = f"http://127.0.0.1:{etcd_port}"
        self._run("etcd", "--data-dir", self.dir / "etcd", "--listen-client-urls", etcd,
                  "--advertise-client-urls", etcd, "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                  "--unsafe-no-fsync", "--log-level", "warn")
        self._wait("etcd", lambda: urllib.request.urlopen(f"{etcd}/health", timeout=2))
        self.server = f"https://127.0.0.1:{api_port}"
        self._run("kube-apiserver", "--etcd-servers", etcd, "--cert-dir", self.dir / "certs",
                  "--secure-port", api_port, "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
                  "--service-cluster-ip-range", "10.0.0.0/24",
                  "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
                  "--service-account-key-file", self.dir / "sa.pub",
                  "--service-account-signing-key-file", self.dir / "sa.key",
                  "--token-auth-file", self.dir / "tokens.csv", "--authorization-mode", "RBAC",
                  "--allow-privileged=true", "--disable-admission-plugins", "ServiceAccount",
                  "--enable-admission-plugins", "OwnerReferencesPermissionEnforcement",
                  "--audit-policy-file", self.dir / "audit-policy.yaml", "--audit-log-path", self.audit_log,
                  "--audit-log-format", "json", "--audit-log-mode", "blocking",
                  "--endpoint-reconciler-type", "none")
        self._wait("kube-apiserver", lambda: (self.dir / "certs" / "apiserver.crt").stat().st_size > 0)
        self._write_kubeconfig()
        self._wait("kube-apiserver", self._api_ready)
        clients = ("--kubeconfig", self.kubeconfig, "--authentication-kubeconfig", self.kubeconfig,
                   "--authorization-kubeconfig", self.kubeconfig, "--leader-elect=false", "--bind-address", "127.0.0.1")
        if self.has("kube-controller-manager"):
            self._run("kube-controller-manager", *clients, "--controllers", "*", "--secure-port", kcm_port,
                      "--service-account-private-key-file", self.dir / "sa.key",
                      "--root-ca-file", self.dir / "certs" / "apiserver.crt",
                      "--service-cluster-ip-range", "10.0.0.0/24")
            self._wait("kube-controller-manager", lambda: self._healthy(kcm_port))
        if self.has("kube-scheduler"):
            self._run("kube-scheduler", *clients, "--secure-port", sched_port)
            self._wait("kube-scheduler", lambda: self._healthy(sched_port))
        return self

    def stop(self) -> None:
        for _name, process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.processes.clear()

    def stop_component(self, component: str, sig: int = signal.SIGKILL) -> None:
        """One component stopped (killed, by default), the others running on: an API server
        outage, say."""
        process = dict(self.processes)[component]
        process.send_signal(sig)
        process.wait(timeout=30)
        self.processes = [(name, p) for name, p in self.processes if p is not process]

    def start_component(self, component: str) -> None:
        """A component stopped by stop_component, started again as it first ran, once ready."""
        self._run(component, *self.arguments[component])
        self._wait(component, self._api_ready if component == "kube-apiserver" else lambda: None)

    def audit(self, user: str, since: int = 0, stages: tuple[str, ...] = ("ResponseComplete",),
              ) -> tuple[list[dict], int]:
        """The audit log's requests by user from byte offset since on (by default the
        completed ones; a watch completes only when it ends: add "ResponseStarted" for those
        under way), and the offset to read on from next time."""
        try:
            with open(self.audit_log, "rb") as log:
                log.seek(since)
                data = log.read()
        except FileNotFoundError:
            return [], since
        complete = data[:data.rfind(b"\n") + 1]   # a line being written is read next time
        events = [json.loads(line) for line in complete.splitlines() if line.strip()]
        return ([e for e in events if e.get("stage") in stages and e["user"]["username"] == user],
                since + len(complete))

    def log(self, component: str, lines: int = 30) -> str:
        text = (self.dir / "logs" / f"{component}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    # ---------------------------------------------------------------- internals

    def _write_credentials(self) -> None:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (self.dir / "sa.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()))
        (self.dir / "sa.pub").write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        (self.dir / "tokens.csv").write_text(f'{self.admin_token},admin,admin-uid,"system:masters"\n'
                                             f"{self.user_token},user,user-uid\n")

    def _write_kubeconfig(self) -> None:
        ca = base64.b64encode((self.dir / "certs" / "apiserver.crt").read_bytes()).decode()
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: local\n  cluster:\n    server: {self.server}\n    certificate-authority-data: {ca}\n"
            f"users:\n- name: admin\n  user:\n    token: {self.admin_token}\n"
            "contexts:\n- name: local\n  context: {cluster: local, user: admin, namespace: default}\n"
            "current-context: local\n")
        self.kubeconfig.chmod(0o600)

    def _run(self, component: str, *args: object) -> None:
        self.arguments[component] = args
        out = open(self.dir / "logs" / f"{component}.log", "wb")
        process = subprocess.Popen([str(self.bin / component), *map(str, args)], stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append((component, process))

    def _wait(self, component: str, probe) -> None:  # type: ignore[no-untyped-def]
        process = dict(self.processes)[component]
        deadline = time.monotonic() + READY_SECONDS
        while True:
            try:
                probe()
                return
            except Exception:  # not up yet: any failure of the probe means wait
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{component} did not become ready:\n{self.log(component)}")
            time.sleep(0.2)

    def _api_ready(self) -> None:
        context = ssl.create_default_context(cafile=str(self.dir / "certs" / "apiserver.crt"))
        request = urllib.request.Request(f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.admin_token}"})
        urllib.request.urlopen(request, timeout=2, context=context)

    def _healthy(self, port: int) -> None:
        urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=2, context=ssl._create_unverified_context())


def tool(name: str) -> str | None:
    """kubectl or helm: the project's fetched copy (make kube-tools), else the PATH's."""
    fetched = REPO / ".cache" / "kube-tools" / "bin" / name
    return str(fetched) if fetched.exists() else shutil.which(name)
