"""A local run's output folder (`distbelief run JOB.yaml --output DIR`) read as a job: its
status.json (the job with the status local mode computes, its pods), its report.json once
the run has ended, its logs/ and, while it runs, its pods' metrics on loopback.

The run holds the folder's lock while it runs (local/outputdir.py): once nothing holds it,
the report the run wrote at its end says how it ended; a run that wrote none (killed) shows
as Stopped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from distbelief.operator import errors
from distbelief.operator.local import livestatus, outputdir
from distbelief.operator.local.ports import LOOPBACK
from distbelief.operator.local.report import REPORT_FILE
from distbelief.operator.plugin import pods as pods_of
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import scrape

FOLLOW_POLL_SECONDS = 0.2
STOPPED = "Stopped"


class LocalJobs:
    """The one job of a local run's folder."""

    local = True

    def __init__(self, folder: str) -> None:
        self.folder = os.path.abspath(folder)
        document = livestatus.read(self.folder)
        if document is None:
            raise errors.OperatorError(f"{self.folder}: no {livestatus.STATUS_FILE}; --local takes the output folder "
                                       "of a `distbelief run` (--output DIR)")
        self.live = outputdir.held(self.folder)
        self.document = document

    def jobs(self, *, all_namespaces: bool = False) -> list[DistBeliefJob]:
        return [self.job(None)]

    def job(self, name: str | None) -> DistBeliefJob:
        job = DistBeliefJob.of(self.document["job"])
        if name not in (None, job.config.name):
            raise errors.OperatorError(f"{self.folder} holds job {job.config.name!r}, not {name!r}")
        if not self.live:
            job = dataclasses.replace(job, status=ended(job.status, self._report()))
        return job

    def _report(self) -> dict[str, Any] | None:
        """report.json when the last run wrote it at its end (it is newer than status.json)."""
        path, status = os.path.join(self.folder, REPORT_FILE), os.path.join(self.folder, livestatus.STATUS_FILE)
        try:
            if os.path.getmtime(path) < os.path.getmtime(status):
                return None
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def pods(self, job: DistBeliefJob) -> list[pods_of.Pod]:
        found = [pods_of.Pod(name=p["name"], role=p["role"], ready=self.live and p["running"], restarts=p["restarts"],
                             phase="Running" if self.live and p["running"] else "Exited")
                 for p in self.document["pods"]]
        return sorted(found, key=lambda p: pods_of.sort_key(job.config, p))

    def events(self, job: DistBeliefJob) -> None:
        return None  # local mode posts no Events

    def metrics(self, pod: pods_of.Pod) -> str:
        if not self.live:
            raise errors.OperatorError(f"the run in {self.folder} has ended: its pods serve no metrics")
        port = next(p["metricsPort"] for p in self.document["pods"] if p["name"] == pod.name)
        return scrape.fetch(f"http://{LOOPBACK}:{port}/metrics").decode(errors="replace")

    def scale(self, name: str, replicas: int) -> None:
        raise errors.OperatorError("scale needs a cluster: a local run keeps the replicas it started with")

    def suspend(self, name: str, suspended: bool) -> None:
        raise errors.OperatorError("suspend and resume need a cluster: Ctrl-C suspends a local run, and running "
                                   "the same command again resumes it")

    def logs(self, pods: list[pods_of.Pod], *, follow: bool, out: TextIO = sys.stdout) -> None:
        """The pods' log files, each line after its pod's name when there are several; with
        follow, what they add until the run ends."""
        files = {p["name"]: os.path.join(self.folder, p["log"]) for p in self.document["pods"]}
        tails = [_Tail(files[pod.name], f"[{pod.name}] " if len(pods) > 1 else "") for pod in pods]
        try:
            for tail in tails:
                tail.show(out)
            while follow:
                running = outputdir.held(self.folder)
                time.sleep(FOLLOW_POLL_SECONDS)
                for tail in tails:
                    tail.show(out)
                if not running:
                    return
        finally:
            for tail in tails:
                tail.close()


class _Tail:
    """A log file read on from where it was left, whole lines only (a line being written
    waits for its end)."""

    def __init__(self, path: str, prefix: str) -> None:
        self.file = open(path, "rb")
        self.prefix, self.partial = prefix, b""

    def show(self, out: TextIO) -> None:
        data = self.partial + self.file.read()
        *lines, self.partial = data.split(b"\n")
        for line in lines:
            out.write(self.prefix + line.decode(errors="replace") + "\n")
        out.flush()

    def close(self) -> None:
        self.file.close()


def ended(status: Mapping[str, Any], report: Mapping[str, Any] | None) -> dict[str, Any]:
    """The status of a run that has ended: its report's phase and reason, or Stopped when it
    wrote no report (killed); no ETA either way."""
    kept = {k: v for k, v in status.items() if k != "eta"}
    for role in ("workers", "parameterServers"):  # no pod runs any more
        kept[role] = {**(status.get(role) or {}), "ready": 0}
    if report and report["phase"] == status.get("phase"):
        return kept  # the run's last status said it already
    phase, reason = (report["phase"], report["reason"]) if report else (
        STOPPED, "NoReport: the run ended without writing its report (killed?)")
    kind, _, message = reason.partition(": ")
    conditions = [c for c in status.get("conditions") or [] if c.get("type") != phase]
    conditions.append({"type": phase, "status": "True", "reason": kind, "message": message or kind})
    return {**kept, "phase": phase, "conditions": conditions}
