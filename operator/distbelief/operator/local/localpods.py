"""Local pods: the rendered StatefulSet's and Deployments' pods as processes on this machine.

Each pod runs its container's command and environment, with loopback ports instead of
cluster DNS and folders instead of volumes (ConfigMaps and Secrets written out as files).
A partitioned job's worker pods serve their stages on a free loopback port each, and
find the rendezvous beside shard 0 on its coordinator port, as Sandblaster's replicas
find the coordinator.
A pod gets SIGTERM when `distbelief run` dies, even by SIGKILL, so none outlives it. Its
resources.limits.memory is held to as a cluster would (podusage.py).
"""

from __future__ import annotations

import base64
import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Mapping, Sequence

from distbelief.operator.local import podusage
from distbelief.operator.local.ports import LOOPBACK, PortChooser
from distbelief.operator.render import podparts
from distbelief.runtime import contract

log = logging.getLogger(__name__)

# The role flags that receive a container port's local number, by port name.
PORT_FLAGS = {contract.SHARD_PORT_NAME: "--port", contract.METRICS_PORT_NAME: "--metrics-port",
              contract.COORDINATOR_PORT_NAME: "--coordinator-port", contract.BULK_PORT_NAME: "--bulk-port"}
SHARD_LINGER_SECONDS = 2.0
VIEWS_FOLDER = "views"
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
    workload: str = ""   # the StatefulSet's or Deployment's name
    namespace: str = "default"
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)   # the pod template's
    memory_limit: str | None = None   # the container's resources.limits.memory, as written
    process: subprocess.Popen | None = None
    restarts: int = 0
    exit_code: int | None = None
    restart_at: float = 0.0
    usage: podusage.PodUsage = dataclasses.field(default_factory=podusage.PodUsage, init=False)
    oom_resident: int | None = dataclasses.field(default=None, init=False)  # set when the watchdog killed it
    _launcher_peak: int = dataclasses.field(default=0, init=False, repr=False)
    # Reaping, signalling and the watchdog's look happen on two threads: one at a time.
    _lock: threading.RLock = dataclasses.field(default_factory=threading.RLock, init=False, repr=False)

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports[contract.METRICS_PORT_NAME]}/metrics"

    @property
    def memory_limit_bytes(self) -> int | None:
        return int(podparts.cpu_cores(self.memory_limit)) if self.memory_limit else None

    def start(self) -> None:
        log_file = open(self.log_path, "ab")
        parent = os.getpid()
        with self._lock:
            self.usage.new_run()
            self.process = subprocess.Popen(self.argv, env=self.env, stdout=log_file, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=lambda: _die_with_parent(parent))
            self._launcher_peak = podusage.own_peak()
            self.exit_code = self.oom_resident = None
        log_file.close()

    def poll(self) -> int | None:
        with self._lock:
            if self.process is not None and self.exit_code is None:
                self.exit_code = self._reap(self.process)
            return self.exit_code

    def _reap(self, process: subprocess.Popen) -> int | None:
        """The exit code once the process has ended (reaped here, for its ru_maxrss), else None."""
        if process.returncode is not None:  # reaped already by Popen: its pid may be another's now
            return process.returncode
        try:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        except ChildProcessError:  # Popen reaped it in between
            return process.poll()
        if pid == 0:
            return None
        if usage.ru_maxrss * 1024 > self._launcher_peak:  # only then is it the pod's own (podusage)
            self.usage.peaked(usage.ru_maxrss * 1024)
        process.returncode = os.waitstatus_to_exitcode(status)
        return process.returncode

    def wait(self) -> None:
        while self.poll() is None:
            time.sleep(0.02)

    @property
    def running(self) -> bool:
        return self.process is not None and self.poll() is None

    def signal(self, sig: int) -> None:
        with self._lock:  # never a pid the process had once it is reaped
            if self.process is not None and self.running:
                os.kill(self.process.pid, sig)

    def watch_memory(self) -> None:
        """Note the process's peak; SIGKILL it when over its memory limit, as a cluster's
        OOM killer would (podusage says how close this comes)."""
        with self._lock:
            process = self.process if self.running else None
            memory = podusage.memory_of(process.pid) if process is not None else None
            if process is None or memory is None:
                return
            self.usage.peaked(memory.peak)
            limit = self.memory_limit_bytes
            if limit is not None and memory.resident > limit and self.oom_resident is None:
                self.oom_resident = memory.resident
                self.usage.oom_kills += 1
                os.kill(process.pid, signal.SIGKILL)
                log.warning("event=pod_oom_killed pod=%s resident_bytes=%d limit=%s", self.name, memory.resident,
                            self.memory_limit)

    def ending(self) -> str:
        """How the process last ended, as a cluster would say it."""
        if self.oom_resident is not None:
            return podusage.oom_message(self.name, self.oom_resident, self.memory_limit or "")
        return f"{self.name} exited with code {self.exit_code}"

    def figures(self) -> dict[str, Any]:
        """The pod's entry in report.json: what it used over the run, across its restarts."""
        entry = {"role": self.role, **self.usage.figures(), "restarts": self.restarts}
        if self.memory_limit:
            entry.update(memoryLimit=self.memory_limit, oomKills=self.usage.oom_kills)
        return entry

    def last_error_line(self) -> str:
        """The role's one-line error ("error: ..."), else its last log line."""
        lines = self._tail()
        return next((line for line in reversed(lines) if line.startswith("error: ")), lines[-1] if lines else "")

    def last_log_line(self) -> str:
        lines = self._tail()
        return lines[-1] if lines else ""

    def _tail(self) -> list[str]:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read()[-4096:].decode(errors="replace").strip().splitlines()
        except OSError:
            return []
        return lines


@dataclasses.dataclass(frozen=True)
class LocalNode:
    """What every local pod of one job shares: the output folder, the rendered ConfigMaps
    and Secrets its volumes come from, its namespace, and the loopback environment."""

    output: str
    sources: Mapping[str, Mapping[str, Any]]
    namespace: str
    env: Mapping[str, str]


def plan_pods(objects: Sequence[Mapping[str, Any]], output: str) -> tuple[list[LocalPod], list[LocalPod]]:
    """The local pods of the rendered StatefulSet and Deployments (one per partition of a
    partitioned job), shards first."""
    sts = next(obj for obj in objects if obj["kind"] == "StatefulSet")
    deployments = [obj for obj in objects if obj["kind"] == "Deployment"]
    shard_names = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    chooser = PortChooser()
    shard_ports = {name: _free_ports(_container(sts), chooser) for name in shard_names}
    addresses = ",".join(f"tcp://{LOOPBACK}:{shard_ports[n][contract.SHARD_PORT_NAME]}" for n in shard_names)
    # A shard's copies keep their view in a file of the output folder, changed under flock.
    env = {contract.ENV_PS_ADDRESSES: addresses, contract.ENV_VIEW_STORE: "file:" + os.path.join(output, VIEWS_FOLDER)}
    coordinator_port = shard_ports[shard_names[0]].get(contract.COORDINATOR_PORT_NAME) if shard_names else None
    if coordinator_port:
        env[contract.ENV_COORDINATOR_ADDRESS] = f"tcp://{LOOPBACK}:{coordinator_port}"
    node = LocalNode(output=output, namespace=sts["metadata"]["namespace"],
                     sources={o["metadata"]["name"]: o for o in objects if o["kind"] in ("ConfigMap", "Secret")},
                     env=env)
    loopback = ["--listen", LOOPBACK]
    shards = [_pod(node, sts, name, shard_ports[name], [*loopback, "--linger", str(SHARD_LINGER_SECONDS)])
              for name in shard_names]
    workers = [_pod(node, deployment, f"{deployment['metadata']['name']}-{i}", _free_ports(_container(deployment), chooser),
                    loopback)
               for deployment in deployments for i in range(deployment["spec"]["replicas"])]
    return shards, workers


def _container(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def _pod(node: LocalNode, workload: Mapping[str, Any], name: str, ports: dict[str, int],
         extra_args: list[str]) -> LocalPod:
    container = _container(workload)
    mounts = _mount_volumes(workload, name, node.output, node.sources)
    args = [local_path(a, mounts) for a in container.get("args", [])]
    for port_name, flag in PORT_FLAGS.items():
        if port_name in ports:
            args += [flag, str(ports[port_name])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **node.env,
           **_container_env(container, pod_name=name, namespace=node.namespace)}
    if contract.STAGE_PORT_NAME in ports:  # every local pod shares the one loopback address
        env[contract.ENV_STAGE_ADDRESS] = f"tcp://{LOOPBACK}:{ports[contract.STAGE_PORT_NAME]}"
    return LocalPod(name=name, role=workload["metadata"]["labels"][contract.LABEL_ROLE],
                    argv=local_command(container["command"]) + args + extra_args, env=env,
                    log_path=os.path.join(node.output, "logs", f"{name}.log"), ports=ports,
                    workload=workload["metadata"]["name"], namespace=node.namespace,
                    labels=workload["spec"]["template"]["metadata"]["labels"],
                    memory_limit=(container.get("resources") or {}).get("limits", {}).get("memory"))


def metrics_targets(pods: list[LocalPod]) -> list[dict[str, Any]]:
    """Each pod's metrics address in Prometheus' file_sd format, labelled as the chart's
    monitors label a cluster's pods: namespace, pod, and the pod labels distbelief.io/job
    and distbelief.io/role as distbelief_io_job and distbelief_io_role."""
    def target_labels(pod: LocalPod) -> dict[str, str]:
        carried = {_label_name(key): pod.labels[key] for key in (contract.LABEL_JOB, contract.LABEL_ROLE)}
        return {"namespace": pod.namespace, "pod": pod.name, **carried}

    return [{"targets": [f"{LOOPBACK}:{pod.ports[contract.METRICS_PORT_NAME]}"], "labels": target_labels(pod)}
            for pod in pods]


def _label_name(pod_label: str) -> str:
    """A pod label's name as Prometheus takes it: every character outside [a-zA-Z0-9_] as _."""
    return "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in pod_label)


def local_command(command: list[str]) -> list[str]:
    """The image's `distbelief` entry point is this interpreter's copy of the CLI."""
    if command and command[0] == "distbelief":
        return [sys.executable, "-m", "distbelief.operator.cli", *command[1:]]
    return list(command)


def _container_env(container: Mapping[str, Any], *, pod_name: str, namespace: str) -> dict[str, str]:
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace, "status.podIP": LOOPBACK}
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") in fields:
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
        if config_map and config_map["name"] in sources:  # else a user's: an empty folder
            for key, text in sources[config_map["name"]]["data"].items():
                with open(os.path.join(folder, key), "w", encoding="utf-8") as f:
                    f.write(text)
        secret = volumes.get(mount["name"], {}).get("secret")
        if secret and secret["secretName"] in sources:
            write_secret(folder, sources[secret["secretName"]], secret.get("items"))
        mounts[mount["mountPath"]] = folder
    return mounts


def write_secret(folder: str, secret: Mapping[str, Any], items: list[Mapping[str, str]] | None) -> None:
    os.chmod(folder, 0o700)
    data = secret["data"]
    for item in items or [{"key": key, "path": key} for key in data]:
        path = os.path.join(folder, item["path"])
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)  # never through a link
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64decode(data[item["key"]]))
        os.chmod(path, 0o600)


def local_path(arg: str, mounts: Mapping[str, str]) -> str:
    for mount_path, folder in mounts.items():
        if arg == mount_path or arg.startswith(mount_path.rstrip("/") + "/"):
            return folder + arg[len(mount_path.rstrip("/")):]
    return arg


def _free_ports(container: Mapping[str, Any], chooser: PortChooser) -> dict[str, int]:
    """A free loopback port for each named container port (ports.py: why not bind(0)'s)."""
    return {port["name"]: chooser.port() for port in container.get("ports", [])}
