"""Local mode: run a DistBeliefJob on this machine, as the cluster would, without one.

`distbelief run JOB.yaml` validates the job, renders exactly the children the operator
would create, and then plays the kubelet's part: one local process per pod (one per
shard of the StatefulSet, one per pod of each worker Deployment) running the container's
command and environment, with loopback ports instead of cluster DNS, folders instead of
volumes, and restart-on-crash with back-off. It shows live progress scraped from the
chief's metrics, and leaves a report in the output folder:

    report.json    phase, reason, globalStep, loss, accuracy, examplesPerSecond, wallSeconds, restarts,
                   and pods.<pod>: peakRssBytes, bytesIn, bytesOut, restarts (podusage.py)
    training.png   training and held-out loss, accuracy and examples/s over steps
    curves.jsonl   the training figures behind the plot, and where each run started
    status.json    the job's status and its pods while it runs (livestatus.py)
    params.npz     the trained parameters, one array per named tensor
    logs/          one log per pod; volumes/ holds each pod's folders (the checkpoints)
    keys/          the job's CurveZMQ keys (0600 files), made on the first run
    metrics-targets.json   each pod's metrics address, for a Prometheus (file_sd_configs)

Running the same job again with the same output folder resumes from its checkpoints,
with the same keys. The keys play the Secret the operator would create: each pod's
secret volume gets a copy of the files its volume lists (0600, in the pod's folder).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Mapping

from distbelief.operator.local import curves, livestatus, outputdir, podusage, preflight, report, resharding
from distbelief.operator.local.localpods import LocalPod, metrics_targets, plan_pods, volume_dir
from distbelief.operator.render import context, render, secret, sizing
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import scrape
from distbelief.operator.status.status import CHIEF_ENDED, SUSPENDED, TERMINAL, Observed, compute_status
from distbelief.runtime import contract, keys

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5
STOP_GRACE_SECONDS = 15.0
BACKOFF_START, BACKOFF_MAX = 1.0, 30.0
# Polls in a row a replica's last minibatch loss must be non-finite before the job fails:
# the shards drop such pushes, so a diverged model would otherwise hang the job.
KEYS_FOLDER = "keys"
TARGETS_FILE = "metrics-targets.json"
# The signals that stop a run as Ctrl-C does: every pod checkpoints, the run ends Suspended.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _decided(result: Mapping[str, Any] | None) -> scrape.Figures | None:
    """The chief's decision as its metrics show it, from the result.json it wrote."""
    if result is None:
        return None
    degraded = result.get("degraded") or {}
    lost = {int(shard): int(n) for shard, n in (result.get("updatesLost") or {}).items()}
    return scrape.Figures(global_step=int(result.get("globalStep", 0)), finished_outcome=result["phase"],
                          finished_reason=result["reason"], degraded_reason=degraded.get("reason"),
                          degraded_message=degraded.get("message"), updates_lost=lost or None)


def run_file(path: str, *, output: str | None, progress: bool, fresh: bool = False) -> int:
    job = DistBeliefJob.validated(spec.load_single(path, "distbelief run"))
    checked = preflight.check(job)
    for line in sizing.memory_warnings(job.config.spec, checked.parameters):
        sys.stderr.write(f"warning: {line}\n")
    output = os.path.abspath(output or os.path.join("out", job.config.name))
    with outputdir.locked(output):
        if fresh:
            outputdir.clear(output)
        resharded = resharding.reshard_output(output, job.config, checked.layout)
        if resharded:
            sys.stdout.write(resharded.announcement() + "\n")
        found = outputdir.earlier(output, job.config, checked.layout.hash)
        announcement = found.announcement()
        if announcement:
            sys.stdout.write(announcement + "\n")
        if found.result:
            return _exit_code(found.result["phase"])
        return LocalRun(job, output).run(progress=progress, resumed_at=found.step or 0)


def _shard_failure(pod: LocalPod) -> str:
    last = pod.last_log_line()
    return f"{pod.ending()}; last log line: {last}" if last else pod.ending()


def _exit_code(phase: str) -> int:
    return {contract.SUCCEEDED: 0, SUSPENDED: 130}.get(phase, 1)


class LocalRun:
    def __init__(self, job: DistBeliefJob, output: str) -> None:
        self.job = job
        self.name = job.config.name
        self.output = output
        os.makedirs(os.path.join(output, "logs"), exist_ok=True)
        job_keys = keys.ensure(os.path.join(output, KEYS_FOLDER))
        objects = [secret.render_keys_secret(job, job_keys.files()),
                   *render.render_children(job, image=context.DEFAULT_IMAGE)]
        self.shards, self.workers = plan_pods(objects, output)
        self._interrupted = False
        self.status: dict[str, Any] = {}
        self._history_at_start = 0

    @property
    def pods(self) -> list[LocalPod]:
        return self.shards + self.workers

    @property
    def chief_dir(self) -> str:
        return volume_dir(self.output, self.shards[0].name, contract.CHECKPOINT_VOLUME)

    def run(self, *, progress: bool, resumed_at: int = 0) -> int:
        started = time.time()
        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, self.interrupt) for sig in STOP_SIGNALS} if in_main_thread else {}
        log.info("event=local_run job=%s shards=%d workers=%d output=%s", self.name, len(self.shards),
                 len(self.workers), self.output)
        live = report.Progress(self.name, total=self.job.config.spec.training.max_steps, enabled=progress,
                               initial=resumed_at)
        recorder = curves.Recorder(self.output, resumed_at=resumed_at)
        self._history_at_start = self._history_size()
        self._write_targets()
        # The bulk ports' Unix sockets: a folder only this user may use, gone with the run.
        with podusage.MemoryWatchdog(lambda: self.pods), tempfile.TemporaryDirectory(prefix="distbelief-") as sockets:
            try:
                for pod in self.pods:
                    pod.env[contract.ENV_SOCKET_DIR] = sockets
                    pod.start()
                phase, reason = self._supervise(live, recorder)
            finally:
                self._stop_all()
                live.close()
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        summary = report.write(self.output, self.chief_dir, job=self.name, phase=phase, reason=reason,
                               started=started, pods={pod.name: pod.figures() for pod in self.pods},
                               staleness=self.status.get("staleness"), shards=self.status.get("shards"),
                               conditions=self.status.get("conditions"))
        report.print_summary(summary, self.output)
        return _exit_code(phase)

    def _write_targets(self) -> None:
        """This run's pods' metrics addresses (new ports each run), replaced whole: a
        Prometheus watching the file never reads half of it."""
        path = os.path.join(self.output, TARGETS_FILE)
        with open(path + ".part", "w", encoding="utf-8") as f:
            json.dump(metrics_targets(self.pods), f, indent=1)
        os.replace(path + ".part", path)

    def interrupt(self, *_: object) -> None:
        """Stop the run as Ctrl-C (or SIGTERM, SIGHUP) does: every pod checkpoints and exits;
        phase Suspended."""
        self._interrupted = True

    def _supervise(self, live: "report.Progress", recorder: curves.Recorder) -> tuple[str, str]:
        """Keep the pods running until the job's status is final (the operator's state machine,
        fed what this machine observes), or until Ctrl-C."""
        while True:
            if self._interrupted:
                return "Suspended", "Interrupted: checkpoints kept; run again to resume"
            seen = self._scrape_pods()
            figures = seen.get(self.shards[0].name, scrape.Figures())
            replicas = {pod.name: seen[pod.name] for pod in self.workers if pod.name in seen}
            status = self._status(figures)
            if status["phase"] in TERMINAL:
                return self._ending(status)
            if all(pod.poll() == 0 for pod in self.shards):
                return contract.FAILED, "ShardsExitedWithoutResult: the shards stopped before the chief decided"
            self._restart_crashed()
            live.update(figures, evaluated=self._history_size() > self._history_at_start)
            recorder.record(figures, replicas)
            time.sleep(POLL_SECONDS)

    def _history_size(self) -> int:
        """Bytes in the chief's history: it grows with each evaluation."""
        try:
            return os.path.getsize(os.path.join(self.chief_dir, contract.HISTORY_FILE))
        except OSError:
            return 0

    def _scrape_pods(self) -> dict[str, scrape.Figures]:
        """Each running pod's own figures, by pod name: the chief's are shard 0's; a replica's
        its loss and examples; every pod's, its traffic (noted: the last value seen counts)."""
        seen = {pod.name: scrape.read(pod.metrics_url, timeout=report.SCRAPE_TIMEOUT)
                for pod in self.pods if pod.running}
        for pod in self.pods:
            if pod.name in seen:
                pod.usage.scraped(seen[pod.name])
        return seen

    def _status(self, figures: scrape.Figures) -> dict[str, Any]:
        """The job's new status from compute_status, as the operator would write it."""
        if all(pod.poll() == 0 for pod in self.shards):
            figures = _decided(report.read_result(self.chief_dir)) or figures
        self.status = compute_status(dataclasses.replace(self.job, status=self.status), self._observe(figures),
                                     datetime.datetime.now(datetime.timezone.utc))
        livestatus.write(self.output, dataclasses.replace(self.job, status=self.status), self.pods)
        return self.status

    def _observe(self, figures: scrape.Figures) -> Observed:
        """What the operator would read from the cluster, read from the local processes. A
        crashed pod counts its coming restart, as a container's restartCount does."""
        crashed = {pod.name: pod.poll() not in (None, 0) for pod in self.pods}
        restarts = {pod.name: pod.restarts + crashed[pod.name] for pod in self.pods}
        worst = max(self.shards, key=lambda pod: restarts[pod.name])
        invalid = next((pod for pod in self.pods if pod.poll() == contract.EXIT_INVALID_CONFIG), None)
        diverged = next((pod for pod in self.workers if pod.poll() == contract.EXIT_NON_FINITE_LOSS), None)
        return Observed(
            shards_ready=sum(pod.running for pod in self.shards), workers=self._replicas(lambda pod: True),
            workers_ready=self._replicas(lambda pod: pod.running), shard_restarts=restarts[worst.name],
            figures=figures, children_created=True,
            invalid_config=f"{invalid.name}: {invalid.last_error_line()}" if invalid else None,
            shard_failure=_shard_failure(worst) if crashed[worst.name] else None,
            non_finite_loss=f"{diverged.name}: {diverged.last_error_line()}" if diverged else None)

    def _replicas(self, counted: Callable[[LocalPod], bool]) -> int:
        """Model replicas whose pods all count: one pod of each partition's Deployment makes
        one, so the Deployment with the fewest counted pods tells (as on a cluster)."""
        workloads = {pod.workload for pod in self.workers}
        return min((sum(counted(pod) for pod in self.workers if pod.workload == name) for name in workloads),
                   default=0)

    def _ending(self, status: Mapping[str, Any]) -> tuple[str, str]:
        """(phase, reason) of a final status. The chief's own decision is let finish: the shards
        write the result, the parameters and their last checkpoints, and exit."""
        phase = status["phase"]
        condition = next(c for c in status["conditions"] if c["type"] == phase)
        if condition.get("message", "").startswith(CHIEF_ENDED):
            self._wait_for_shards()
            return phase, condition["reason"]
        return phase, f"{condition['reason']}: {condition.get('message', '')}"

    def _wait_for_shards(self) -> None:
        """Until the shards exit (or STOP_GRACE_SECONDS), pods are looked after as before,
        as a kubelet does until the operator scales the job down."""
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while any(pod.running for pod in self.shards) and time.monotonic() < deadline:
            self._restart_crashed()
            time.sleep(0.1)

    def _restart_crashed(self) -> None:
        """Restart crashed pods with back-off; one that exited with a config error, or a replica
        whose loss went non-finite, never is (a restart cannot help either)."""
        now = time.monotonic()
        for pod in self.pods:
            code = pod.poll()
            if code in (None, 0, contract.EXIT_INVALID_CONFIG, contract.EXIT_NON_FINITE_LOSS):
                continue
            if pod.restart_at == 0.0:
                delay = min(BACKOFF_MAX, BACKOFF_START * 2 ** pod.restarts)
                pod.restart_at = now + delay
                log.warning("event=pod_crashed pod=%s exit_code=%d restart_in_s=%.0f ended=%r", pod.name, code, delay,
                            pod.ending())
            elif now >= pod.restart_at:
                pod.restarts += 1
                pod.restart_at = 0.0
                pod.start()

    def _stop_all(self) -> None:
        """SIGTERM every pod (the shards checkpoint on it), then SIGKILL what remains."""
        self._scrape_pods()  # the traffic up to now
        for pod in self.workers + self.shards:
            pod.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while any(pod.running for pod in self.pods) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pod in self.pods:
            if pod.running:
                log.warning("event=pod_killed pod=%s reason=did_not_stop_in_%.0fs", pod.name, STOP_GRACE_SECONDS)
                pod.signal(signal.SIGKILL)
                pod.wait()
