"""One pod bound to this node, its containers run as local processes (localpods.LocalPod).

    first sync      the pod's volumes made (volumes.py), each container's command line and
                    environment worked out (containers.py, roles.py); a missing ConfigMap,
                    Secret or unbound claim leaves the containers ContainerCreating, tried again
    every sync      each container started when due, its probes run (probes.py); one that
                    ended is restarted as restartPolicy says (Always; OnFailure after a
                    non-zero exit; Never), after a back-off that doubles from backoff_start
                    to backoff_max (CrashLoopBackOff meanwhile) and is forgotten once a run
                    lasted twice backoff_max; a liveness probe that fails ends the run
    stop(grace)     SIGTERM to every container, SIGKILL to what remains after grace seconds
                    (and to the rest of its process group), no restarts after it

Memory limits are held by local mode's watchdog (podusage.MemoryWatchdog over every
container's LocalPod): over its resources.limits.memory, a container is SIGKILLed and
ends OOMKilled (exit code 137).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import threading
import time
from typing import Any, Mapping

from distbelief.operator import errors
from distbelief.operator.local import localpods
from localnode import api as node_api, containers, podstatus, probes, roles, volumes
from localnode.addresses import HOST_IP, PodNetwork

log = logging.getLogger(__name__)

Manifest = dict[str, Any]
PREPARE_RETRY_SECONDS = 2.0
MESSAGE_BYTES = 4096          # of a termination message file, as a kubelet reads it
LOG_MESSAGE_BYTES, LOG_MESSAGE_LINES = 2048, 80   # of the log, for FallbackToLogsOnError


@dataclasses.dataclass(frozen=True)
class NodeContext:
    """What every pod of the node shares."""

    api: node_api.Api
    network: PodNetwork
    root: str
    capacity: Mapping[str, str]
    prober: probes.Prober
    backoff_start: float = 1.0
    backoff_max: float = 30.0


@dataclasses.dataclass
class ContainerRun:
    """A container of the pod: its process (made on the first start), its status, its back-off."""

    spec: Mapping[str, Any]
    state: podstatus.ContainerState
    process: localpods.LocalPod | None = None
    termination_file: str = ""
    started: float = 0.0         # time.monotonic() of the current or last start
    log_offset: int = 0          # where the current run's log begins
    crashes: int = 0             # quick ends in a row, for the back-off
    start_at: float | None = 0.0  # when to start next; None: never again
    readiness: probes.Probe | None = None
    liveness: probes.Probe | None = None
    killing: bool = False

    @property
    def running(self) -> bool:
        return self.process is not None and self.state.running_since is not None


class NodePod:
    def __init__(self, manifest: Manifest, ctx: NodeContext) -> None:
        self.manifest, self.ctx = manifest, ctx
        meta = manifest["metadata"]
        self.uid, self.name, self.namespace = meta["uid"], meta["name"], meta["namespace"]
        self.ip = HOST_IP if manifest["spec"].get("hostNetwork") else ctx.network.ip(self.namespace, self.name)
        self.folder = os.path.join(ctx.root, "pods", self.uid)
        self.log_folder = os.path.join(ctx.root, "logs", f"{self.namespace}_{self.name}_{self.uid}")
        self.runs = [ContainerRun(spec=c, state=podstatus.ContainerState(c["name"], c.get("image", "")))
                     for c in manifest["spec"]["containers"]]
        self.start_time = podstatus.now_text()
        self.prepared = False
        self.prepare_at = 0.0
        self.stopping = False
        self.ever_started = False
        self.written: Manifest | None = None
        self._lock = threading.RLock()

    @property
    def processes(self) -> list[localpods.LocalPod]:
        return [run.process for run in self.runs if run.process is not None]

    @property
    def grace_seconds(self) -> float:
        meta, spec = self.manifest["metadata"], self.manifest["spec"]
        grace = meta.get("deletionGracePeriodSeconds", spec.get("terminationGracePeriodSeconds", 30))
        return float(30 if grace is None else grace)

    def sync(self) -> None:
        with self._lock:
            if not self.prepared and not self.stopping and time.monotonic() >= self.prepare_at:
                self._prepare()
            for run in self.runs:
                self._sync_run(run)

    def status(self) -> Manifest:
        with self._lock:
            return podstatus.pod_status(self.manifest, [run.state for run in self.runs],
                                        ever_started=self.ever_started, pod_ip=self.ip, host_ip=HOST_IP,
                                        start_time=self.start_time, now=podstatus.now_text())

    def write_status(self) -> None:
        """Patch the pod's status when it changed since the last write."""
        status = self.status()
        if status != self.written:
            self.ctx.api.patch_path(node_api.path("v1", "pods", self.namespace, self.name, "status"),
                                    {"status": status})
            self.written = status

    def stop(self, grace: float) -> None:
        """SIGTERM every container, SIGKILL after grace seconds; nothing restarts after it."""
        with self._lock:
            self.stopping = True
            for run in self.runs:
                run.start_at = None
        _stop_processes([run.process for run in self.runs if run.running], grace)
        self.sync()

    def remove_folder(self) -> None:
        """The pod's volumes (not the claims' folders, nor the logs)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    # ---------------------------------------------------------------- the containers

    def _prepare(self) -> None:
        try:
            if self.manifest["spec"].get("initContainers"):
                raise errors.ContainerConfigError("local-node does not run init containers")
            made = volumes.prepare(self.ctx.api, self.manifest, os.path.join(self.folder, "volumes"))
            for run in self.runs:
                run.process = self._process(run, made)
        except (errors.VolumeError, errors.ContainerConfigError, OSError, ValueError, KeyError) as exc:
            reason = "ContainerCreating" if isinstance(exc, errors.VolumeError) else "CreateContainerConfigError"
            for run in self.runs:
                run.state.waiting = (reason, str(exc))
            self.prepare_at = time.monotonic() + PREPARE_RETRY_SECONDS
            log.info("event=pod_not_ready_to_start pod=%s/%s reason=%s detail=%s", self.namespace, self.name,
                     reason, exc)
            return
        self.prepared = True

    def _process(self, run: ContainerRun, made: Mapping[str, str]) -> localpods.LocalPod:
        spec = run.spec
        mounts = volumes.mounts(spec, made)
        run.termination_file = os.path.join(self.folder, "termination", spec["name"])
        os.makedirs(os.path.dirname(run.termination_file), exist_ok=True)
        os.makedirs(self.log_folder, exist_ok=True)
        local = containers.localizer(mounts, run.termination_file,
                                     spec.get("terminationMessagePath") or containers.TERMINATION_LOG)
        fields = containers.downward_fields(self.manifest, self.ip, HOST_IP)
        env = containers.environment(self.ctx.api, self.manifest, spec, fields, self.ctx.capacity, local)
        if "/tmp" in mounts:
            env["TMPDIR"] = mounts["/tmp"]
        argv = containers.argv(spec, env, local)
        if roles.is_role(containers.entrypoint(spec) + list(spec.get("args") or [])):
            argv, extra = roles.adapt(argv, pod_ip=self.ip, network=self.ctx.network)
            env.update(extra)
        limits = (spec.get("resources") or {}).get("limits") or {}
        return localpods.LocalPod(
            name=f"{self.namespace}/{self.name}/{spec['name']}", role=spec["name"], argv=argv, env=env,
            log_path=os.path.join(self.log_folder, f"{spec['name']}.log"),
            ports={p["name"]: int(p["containerPort"]) for p in spec.get("ports") or [] if p.get("name")},
            memory_limit=str(limits["memory"]) if "memory" in limits else None)

    def _sync_run(self, run: ContainerRun) -> None:
        if run.running:
            if run.process.poll() is None:
                self._probe(run)
                return
            self._ended(run, run.process.exit_code)
        if self.prepared and run.start_at is not None and not self.stopping and time.monotonic() >= run.start_at:
            self._start(run)

    def _probe(self, run: ContainerRun) -> None:
        for probe in (run.readiness, run.liveness):
            self.ctx.prober.tick(probe)
        run.state.ready = run.readiness.healthy if run.readiness else True
        if run.liveness and not run.liveness.healthy and not run.killing:
            run.killing = True
            log.warning("event=liveness_failed pod=%s/%s container=%s", self.namespace, self.name, run.spec["name"])
            threading.Thread(target=_stop_processes, args=([run.process], self.grace_seconds), daemon=True).start()

    def _start(self, run: ContainerRun) -> None:
        if run.started:
            run.state.restarts += 1
        run.started, run.killing = time.monotonic(), False
        run.log_offset = _size(run.process.log_path)
        with open(run.termination_file, "w"):
            pass
        try:
            run.process.start()
        except OSError as exc:  # no such command, not executable: the run ends at once
            run.state.running_since = podstatus.now_text()
            self._ended(run, 128, start_error=f"failed to start {run.process.argv[0]}: {exc}")
            return
        self.ever_started = True
        run.state.pid, run.state.running_since = run.process.process.pid, podstatus.now_text()
        run.state.waiting = run.state.terminated = None
        run.start_at = None
        target = probes.Target(self.ip, run.process.ports, run.process.env)
        run.readiness = probes.Probe(run.spec["readinessProbe"], target, healthy=False) \
            if run.spec.get("readinessProbe") else None
        run.liveness = probes.Probe(run.spec["livenessProbe"], target, healthy=True) \
            if run.spec.get("livenessProbe") else None

    def _ended(self, run: ContainerRun, code: int | None, start_error: str = "") -> None:
        code = 128 - code if code is not None and code < 0 else (code or 0)  # killed by a signal: 128 + its number
        oom = run.process.oom_resident is not None
        end = podstatus.terminated(code, started=run.state.running_since, finished=podstatus.now_text(),
                                   message=start_error or self._message(run, code), oom=oom, pid=run.state.pid)
        if start_error:
            end["reason"] = "StartError"
        run.state.running_since, run.state.ready = None, False
        if time.monotonic() - run.started > 2 * self.ctx.backoff_max:
            run.crashes = 0
        policy = self.manifest["spec"].get("restartPolicy", "Always")
        if self.stopping or policy == "Never" or (policy == "OnFailure" and code == 0):
            run.state.terminated, run.start_at = end, None
            log.info("event=container_ended pod=%s/%s container=%s exit_code=%d reason=%s", self.namespace,
                     self.name, run.spec["name"], code, end["reason"])
            return
        delay = min(self.ctx.backoff_max, self.ctx.backoff_start * 2 ** run.crashes)
        run.crashes += 1
        run.state.last, run.start_at = end, time.monotonic() + delay
        run.state.waiting = ("CrashLoopBackOff", f"back-off {delay:g}s restarting failed container={run.spec['name']} "
                                                 f"pod={self.name}_{self.namespace}({self.uid})")
        log.warning("event=container_restart_scheduled pod=%s/%s container=%s exit_code=%d reason=%s in_s=%g",
                    self.namespace, self.name, run.spec["name"], code, end["reason"], delay)

    def _message(self, run: ContainerRun, code: int) -> str:
        """The termination message file's text, else (FallbackToLogsOnError, a failed run) the
        end of the run's log."""
        try:
            with open(run.termination_file, "rb") as f:
                text = f.read(MESSAGE_BYTES).decode(errors="replace")
        except OSError:
            text = ""
        if text or code == 0 or run.spec.get("terminationMessagePolicy") != "FallbackToLogsOnError":
            return text
        try:
            with open(run.process.log_path, "rb") as f:
                f.seek(max(run.log_offset, _size(run.process.log_path) - LOG_MESSAGE_BYTES))
                tail = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(tail.splitlines()[-LOG_MESSAGE_LINES:])


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _stop_processes(processes: list[localpods.LocalPod], grace: float) -> None:
    """SIGTERM, then SIGKILL to the process and its group after grace seconds, as a
    container runtime stops a container."""
    for process in processes:
        process.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.running for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    for process in processes:
        if process.running:
            log.warning("event=container_killed pod=%s reason=did_not_stop_in_%gs", process.name, grace)
            process.signal(signal.SIGKILL)
            process.wait()
        try:
            os.killpg(process.process.pid, signal.SIGKILL)  # what the container's process left behind
        except (ProcessLookupError, PermissionError):
            pass
