"""Local mode: run a DistBeliefJob on this machine, as the cluster would, without one.

`distbelief run JOB.yaml` validates the job, renders exactly the children the operator
would create, and then plays the kubelet's part: one local process per pod (one per
shard of the StatefulSet, one per replica of the Deployment) running the container's
command and environment, with loopback ports instead of cluster DNS, folders instead of
volumes, and restart-on-crash with back-off. It shows live progress scraped from the
chief's metrics, and leaves a report in the output folder:

    report.json    phase, reason, globalStep, loss, accuracy, examplesPerSecond, wallSeconds, restarts
    training.png   held-out loss and accuracy over time
    params.npz     the trained parameters, one array per named tensor
    logs/          one log per pod; volumes/ holds each pod's folders (the checkpoints)
    keys/          the job's CurveZMQ keys (0600 files), made on the first run

Running the same job again with the same output folder resumes from its checkpoints,
with the same keys. The keys play the Secret the operator would create: each pod's
secret volume gets a copy of the files its volume lists (0600, in the pod's folder).
"""

from __future__ import annotations

import base64
import ctypes
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Mapping

from distbelief.operator import render, report, spec
from distbelief.runtime import contract, keys

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5
STOP_GRACE_SECONDS = 15.0
SHARD_LINGER_SECONDS = 2.0
BACKOFF_START, BACKOFF_MAX = 1.0, 30.0
KEYS_FOLDER = "keys"
# The role flags that receive a container port's local number, by port name.
PORT_FLAGS = {contract.SHARD_PORT_NAME: "--port", contract.METRICS_PORT_NAME: "--metrics-port",
              contract.COORDINATOR_PORT_NAME: "--coordinator-port"}
# The signals that stop a run as Ctrl-C does: every pod checkpoints, the run ends Suspended.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent(parent: int) -> None:
    """In a pod's process, before it runs: SIGTERM it when `distbelief run` dies, even by SIGKILL
    (Linux's parent-death signal; the pod then checkpoints and exits as on Ctrl-C)."""
    if _LIBC is None:
        return
    _LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


@dataclasses.dataclass
class LocalPod:
    """One pod of the rendered children, as a local process."""

    name: str
    role: str
    argv: list[str]
    env: dict[str, str]
    log_path: str
    ports: dict[str, int]
    process: subprocess.Popen | None = None
    restarts: int = 0
    exit_code: int | None = None
    restart_at: float = 0.0

    def start(self) -> None:
        log_file = open(self.log_path, "ab")
        parent = os.getpid()
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=log_file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=lambda: _die_with_parent(parent))
        log_file.close()
        self.exit_code = None

    def poll(self) -> int | None:
        if self.process is not None and self.exit_code is None:
            self.exit_code = self.process.poll()
        return self.exit_code

    @property
    def running(self) -> bool:
        return self.process is not None and self.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            self.process.send_signal(sig)

    def last_log_line(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read()[-4096:].decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1] if lines else ""


def run_file(path: str, *, output: str | None, progress: bool, fresh: bool = False) -> int:
    docs = spec.load_manifests(path)
    if len(docs) != 1:
        raise spec.SpecError(f"{path}: local mode runs one DistBeliefJob per file, found {len(docs)} documents")
    job = spec.validate_job(docs[0])
    name = job["metadata"]["name"]
    output = os.path.abspath(output or os.path.join("out", name))
    if fresh:
        shutil.rmtree(output, ignore_errors=True)
    return LocalRun(job, output).run(progress=progress)


class LocalRun:
    def __init__(self, job: Mapping[str, Any], output: str) -> None:
        self.job = job
        self.name = job["metadata"]["name"]
        self.spec = job["spec"]
        self.output = output
        self.backoff_limit = int(self.spec["runPolicy"]["backoffLimit"])
        os.makedirs(os.path.join(output, "logs"), exist_ok=True)
        job_keys = keys.ensure(os.path.join(output, KEYS_FOLDER))
        objects = [render.render_keys_secret(job, job_keys.files()),
                   *render.render_children(job, image=render.DEFAULT_IMAGE)]
        self.shards, self.workers = plan_pods(objects, output)
        self._interrupted = False

    @property
    def pods(self) -> list[LocalPod]:
        return self.shards + self.workers

    @property
    def chief_dir(self) -> str:
        return volume_dir(self.output, self.shards[0].name, contract.CHECKPOINT_VOLUME)

    def run(self, *, progress: bool) -> int:
        started = time.time()
        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, self.interrupt) for sig in STOP_SIGNALS} if in_main_thread else {}
        log.info("event=local_run job=%s shards=%d workers=%d output=%s", self.name, len(self.shards),
                 len(self.workers), self.output)
        live = report.Progress(self.name, total=int(self.spec["training"]["maxSteps"]),
                               metrics_port=self.shards[0].ports[contract.METRICS_PORT_NAME], enabled=progress)
        try:
            for pod in self.pods:
                pod.start()
            phase, reason = self._supervise(live)
        finally:
            self._stop_all()
            live.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        restarts = {pod.name: pod.restarts for pod in self.pods}
        summary = report.write(self.output, self.chief_dir, job=self.name, phase=phase, reason=reason,
                               wall_seconds=time.time() - started, restarts=restarts)
        report.print_summary(summary, self.output)
        return {"Succeeded": 0, "Suspended": 130}.get(phase, 1)

    def interrupt(self, *_: object) -> None:
        """Stop the run as Ctrl-C (or SIGTERM, SIGHUP) does: every pod checkpoints and exits;
        phase Suspended."""
        self._interrupted = True

    def _supervise(self, live: "report.Progress") -> tuple[str, str]:
        """Keep the pods running until the shards finish, a pod fails too often, or Ctrl-C."""
        while True:
            if self._interrupted:
                return "Suspended", "Interrupted: checkpoints kept; run again to resume"
            failed = self._restart_crashed()
            if failed:
                return "Failed", failed
            if all(pod.poll() == 0 for pod in self.shards):
                result = report.read_result(self.chief_dir)
                if result is None:
                    return "Failed", "ShardsExitedWithoutResult: the shards stopped before the chief decided"
                return result["phase"], result["reason"]
            live.update()
            time.sleep(POLL_SECONDS)

    def _restart_crashed(self) -> str | None:
        now = time.monotonic()
        for pod in self.pods:
            code = pod.poll()
            if code is None or code == 0:
                continue
            if pod.restart_at == 0.0:
                if pod.restarts >= self.backoff_limit:
                    return (f"BackoffLimitExceeded: {pod.name} exited with code {code} "
                            f"{pod.restarts + 1} times; last log line: {pod.last_log_line()}")
                delay = min(BACKOFF_MAX, BACKOFF_START * 2 ** pod.restarts)
                pod.restart_at = now + delay
                log.warning("event=pod_crashed pod=%s exit_code=%d restart_in_s=%.0f", pod.name, code, delay)
            elif now >= pod.restart_at:
                pod.restarts += 1
                pod.restart_at = 0.0
                pod.start()
        return None

    def _stop_all(self) -> None:
        """SIGTERM every pod (the shards checkpoint on it), then SIGKILL what remains."""
        for pod in self.workers + self.shards:
            pod.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while any(pod.running for pod in self.pods) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pod in self.pods:
            if pod.running:
                log.warning("event=pod_killed pod=%s reason=did_not_stop_in_%.0fs", pod.name, STOP_GRACE_SECONDS)
                pod.signal(signal.SIGKILL)
                pod.process.wait()


# -- from rendered children to local pods ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class LocalNode:
    """What every local pod of one job shares: the output folder, the rendered ConfigMaps
    and Secrets its volumes come from, its namespace, and the loopback environment."""

    output: str
    sources: Mapping[str, Mapping[str, Any]]
    namespace: str
    env: Mapping[str, str]


def plan_pods(objects: list[Mapping[str, Any]], output: str) -> tuple[list[LocalPod], list[LocalPod]]:
    """The local pods of the rendered StatefulSet and Deployment, shards first."""
    by_kind = {obj["kind"]: obj for obj in objects}
    sts, deployment = by_kind["StatefulSet"], by_kind["Deployment"]
    shard_names = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    shard_ports = {name: _free_ports(_container(sts)) for name in shard_names}
    addresses = ",".join(f"tcp://127.0.0.1:{shard_ports[n][contract.SHARD_PORT_NAME]}" for n in shard_names)
    env = {contract.ENV_PS_ADDRESSES: addresses}
    coordinator_port = shard_ports[shard_names[0]].get(contract.COORDINATOR_PORT_NAME) if shard_names else None
    if coordinator_port:
        env[contract.ENV_COORDINATOR_ADDRESS] = f"tcp://127.0.0.1:{coordinator_port}"
    node = LocalNode(output=output, namespace=sts["metadata"]["namespace"],
                     sources={o["metadata"]["name"]: o for o in objects if o["kind"] in ("ConfigMap", "Secret")},
                     env=env)
    loopback = ["--listen", "127.0.0.1"]
    shards = [_pod(node, sts, name, shard_ports[name], [*loopback, "--linger", str(SHARD_LINGER_SECONDS)])
              for name in shard_names]
    worker_base = deployment["metadata"]["name"]
    workers = [_pod(node, deployment, f"{worker_base}-{i}", _free_ports(_container(deployment)), loopback)
               for i in range(deployment["spec"]["replicas"])]
    return shards, workers


def _container(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def _pod(node: LocalNode, workload: Mapping[str, Any], name: str, ports: dict[str, int],
         extra_args: list[str]) -> LocalPod:
    container = _container(workload)
    mounts = _mount_volumes(workload, name, node.output, node.sources)
    args = [_local_path(a, mounts) for a in container.get("args", [])]
    for port_name, flag in PORT_FLAGS.items():
        if port_name in ports:
            args += [flag, str(ports[port_name])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **node.env,
           **_container_env(container, pod_name=name, namespace=node.namespace)}
    return LocalPod(name=name, role=workload["metadata"]["labels"][contract.LABEL_ROLE],
                    argv=_local_command(container["command"]) + args + extra_args, env=env,
                    log_path=os.path.join(node.output, "logs", f"{name}.log"), ports=ports)


def _local_command(command: list[str]) -> list[str]:
    """The image's `distbelief` entry point is this interpreter's copy of the CLI."""
    if command and command[0] == "distbelief":
        return [sys.executable, "-m", "distbelief.operator.cli", *command[1:]]
    return list(command)


def _container_env(container: Mapping[str, Any], *, pod_name: str, namespace: str) -> dict[str, str]:
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace}
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def volume_dir(output: str, pod_name: str, volume: str) -> str:
    return os.path.join(output, "volumes", pod_name, volume)


def _mount_volumes(workload: Mapping[str, Any], pod_name: str, output: str,
                   sources: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """A local folder for each of the container's mounts: ConfigMaps and Secrets written out
    as files (a Secret's 0600, only the items the volume lists), volume claims and emptyDirs
    as the pod's own folders. Returns mountPath -> folder."""
    pod_spec = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts = {}
    for mount in _container(workload).get("volumeMounts", []):
        folder = volume_dir(output, pod_name, mount["name"])
        os.makedirs(folder, exist_ok=True)
        config_map = volumes.get(mount["name"], {}).get("configMap")
        if config_map:
            for key, text in sources[config_map["name"]]["data"].items():
                with open(os.path.join(folder, key), "w", encoding="utf-8") as f:
                    f.write(text)
        secret = volumes.get(mount["name"], {}).get("secret")
        if secret:
            _write_secret(folder, sources[secret["secretName"]], secret.get("items"))
        mounts[mount["mountPath"]] = folder
    return mounts


def _write_secret(folder: str, secret: Mapping[str, Any], items: list[Mapping[str, str]] | None) -> None:
    os.chmod(folder, 0o700)
    data = secret["data"]
    for item in items or [{"key": key, "path": key} for key in data]:
        path = os.path.join(folder, item["path"])
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64decode(data[item["key"]]))
        os.chmod(path, 0o600)


def _local_path(arg: str, mounts: Mapping[str, str]) -> str:
    for mount_path, folder in mounts.items():
        if arg == mount_path or arg.startswith(mount_path.rstrip("/") + "/"):
            return folder + arg[len(mount_path.rstrip("/")):]
    return arg


def _free_ports(container: Mapping[str, Any]) -> dict[str, int]:
    """A free loopback port for each named container port."""
    ports = {}
    for port in container.get("ports", []):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports[port["name"]] = s.getsockname()[1]
    return ports
