"""DistBeliefJobs on the nodes tier's real nodes (tests/nodes): apply one as a user does,
follow it to its end while noting which node ran each of its pods, and say what went
wrong (pods, events, logs, the operator's log) when it does not end well."""

from __future__ import annotations

import json
import time
from typing import Any

import yaml

from support.cluster import Kubectl
from support.nodes import TIMINGS

FINISHED = ("Succeeded", "Failed")


def job_pods(kubectl: Kubectl, namespace: str, job: str) -> list[dict[str, Any]]:
    return kubectl.json("get", "pods", "-n", namespace, "-l", f"distbelief.io/job={job}")["items"]


def status_of(kubectl: Kubectl, namespace: str, job: str) -> dict[str, Any]:
    done = kubectl.run("get", "dbj", job, "-n", namespace, "-o", "json")
    return (json.loads(done.stdout).get("status") or {}) if done.returncode == 0 else {}


def diagnostics(kubectl: Kubectl, namespace: str, operator_namespace: str | None) -> str:
    """What a failure report needs: the pods and where they ran, the events, the last lines
    of every pod's log, the operator's log."""
    parts = [kubectl("get", "dbj,pods,pvc", "-n", namespace, "-o", "wide", check=False),
             kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False)[-4000:]]
    for pod in kubectl.json("get", "pods", "-n", namespace)["items"]:
        name = pod["metadata"]["name"]
        parts.append(f"--- {name} ({pod['spec'].get('nodeName')}): "
                     + kubectl("logs", "-n", namespace, name, "--tail=15", "--all-containers", check=False))
    if operator_namespace:
        parts.append("--- the operator: " + kubectl("logs", "-n", operator_namespace, "-l",
                                                    "app.kubernetes.io/name=distbelief", "--tail=40", check=False))
    return "\n".join(parts)


def train(kubectl: Kubectl, namespace: str, doc: dict[str, Any], *, timeout: float,
          operator_namespace: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Apply the job and wait for its end: its status, and the node each of its pods ran on
    (pod name -> node name, for every pod seen running)."""
    started = time.monotonic()
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    return follow(kubectl, namespace, doc["metadata"]["name"], timeout=timeout, started=started,
                  operator_namespace=operator_namespace)


def follow(kubectl: Kubectl, namespace: str, name: str, *, timeout: float, started: float | None = None,
           operator_namespace: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Wait for the job's end (Succeeded, else AssertionError with the diagnostics): its
    status and where its pods ran."""
    started = time.monotonic() if started is None else started
    placements: dict[str, str] = {}
    deadline = started + timeout
    while True:
        for pod in job_pods(kubectl, namespace, name):
            if pod["spec"].get("nodeName") and (pod.get("status") or {}).get("phase") in ("Running", "Succeeded"):
                placements[pod["metadata"]["name"]] = pod["spec"]["nodeName"]
        status = status_of(kubectl, namespace, name)
        if status.get("phase") in FINISHED:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} did not finish in {timeout:.0f} s; status {json.dumps(status)[-1500:]}\n"
                                 + diagnostics(kubectl, namespace, operator_namespace))
        time.sleep(1)
    TIMINGS.append((f"job {name}: kubectl apply -> {status['phase']}", time.monotonic() - started))
    if status["phase"] != "Succeeded":
        raise AssertionError(f"{name} ended {status['phase']}: {json.dumps(status)[-2000:]}\n"
                             + diagnostics(kubectl, namespace, operator_namespace))
    return status, placements


def assert_learned(kubectl: Kubectl, namespace: str, name: str, status: dict[str, Any], metric: str, floor: float,
                   operator_namespace: str | None = None) -> None:
    """The job's held-out metric beats floor, else an AssertionError that shows how it got
    there: the status' figures and conditions, every pod's evaluations, warnings and errors."""
    if status.get(metric, 0.0) >= floor:
        return
    figures = {k: status.get(k) for k in ("phase", "globalStep", metric, "loss", "restarts", "shards")}
    conditions = [{k: c.get(k) for k in ("type", "status", "reason", "message")} for c in status.get("conditions", [])]
    raise AssertionError(f"{name} ended with {metric} {status.get(metric)} (wanted >= {floor}): {json.dumps(figures)}\n"
                         f"conditions: {json.dumps(conditions)}\n{notable_lines(kubectl, namespace, name)}\n"
                         + diagnostics(kubectl, namespace, operator_namespace))


NOTABLE = ("event=evaluated", "WARNING", "ERROR", "restor", "lost")


def notable_lines(kubectl: Kubectl, namespace: str, job: str) -> str:
    """Each of the job's pods' log lines that tell how training went (the chief's
    evaluations, restores, losses, warnings): the last 40 of each."""
    parts = []
    for pod in job_pods(kubectl, namespace, job):
        name = pod["metadata"]["name"]
        lines = [line for line in kubectl("logs", "-n", namespace, name, "--all-containers", check=False).splitlines()
                 if any(word in line for word in NOTABLE)]
        parts.append(f"--- {name}: {len(lines)} notable lines, the last 40:\n" + "\n".join(lines[-40:]))
    return "\n".join(parts)


def claims(kubectl: Kubectl, namespace: str) -> list[dict[str, Any]]:
    return kubectl.json("get", "pvc", "-n", namespace)["items"]
