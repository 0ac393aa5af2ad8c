"""`kubectl distbelief` as users run it, kubectl finding the installed `kubectl-distbelief` on
the PATH, against one job training on the real control plane (tools/local-node runs its
pods, the operator fills in its status): get, describe, logs, top, scale, suspend, resume."""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.cluster import Kubectl
from support.localnode import (METRICS_URL, LocalNode, apply, chart, example, get,  # noqa: F401 (fixtures)
                               job_status, local_node, operator)
from support.plugin import columns, command, environment, run_plugin
from support.waiting import eventually


def plugin(kubectl: Kubectl, *args: str, env: dict[str, str] | None = None,
           check: bool = True) -> subprocess.CompletedProcess[str]:
    done = run_plugin(*args, kubectl=kubectl.binary, env={**kubectl.plane.env(), **(env or {})})
    if check:
        assert done.returncode == 0, f"kubectl distbelief {' '.join(args)}: exit {done.returncode}\n{done.stderr}"
    return done


def running(kubectl: Kubectl, namespace: str) -> dict[str, Any]:
    return eventually(lambda: (s := job_status(kubectl, namespace, "digits")).get("phase") == "Running"
                      and s.get("eta") and s.get("lastCheckpoint") and s.get("shards") and s, 120, interval=0.3,
                      what="digits Running with an ETA, a checkpoint and its shards' copies")


@pytest.mark.slow
def test_kubectl_distbelief_shows_and_drives_a_training_job(
        kubectl: Kubectl, local_node: LocalNode, namespace: str, operator: Path, tmp_path: Path) -> None:
    job = example("digits-mlp.yaml", training__maxSteps=1_000_000, training__maxDuration="10m",
                  parameterServers__checkpoint__everySeconds=1, parameterServers__backups=1)
    apply(kubectl, namespace, job)
    status = running(kubectl, namespace)
    ns = ("-n", namespace)

    # get: the job's line, its figures those of the status as the operator wrote it. The
    # status drops its ETA for a sample after the rate restarts (a step seen going back, a
    # moment not Running: progress.measure), and get shows "-" then: the next line has one.
    # Progress is in tenths of a percent: 0% for the first few thousand of a million steps.
    def row_with_eta() -> dict[str, str] | None:
        (row,) = columns(plugin(kubectl, "get", *ns).stdout)
        return row if re.fullmatch(r"\d+[smhd](\d+[smh])?", row["ETA"]) and row["PROGRESS"] != "0%" else None
    row = eventually(row_with_eta, 90, interval=0.5, what="kubectl distbelief get showing an ETA and some progress")
    assert (row["NAME"], row["PHASE"]) == ("digits", "Running"), row
    assert 0 < float(row["PROGRESS"].rstrip("%")) < 100 and int(row["STEP"]) >= status["globalStep"], row
    assert 0 <= float(row["ACCURACY"]) <= 1, row
    every = columns(plugin(kubectl, "get", "-A").stdout)
    assert {"NAMESPACE": namespace, "NAME": "digits"}.items() <= next(r for r in every if r["NAMESPACE"] == namespace).items()
    # Without -n: the namespace of the kubeconfig's context (here one naming the test's namespace).
    config = yaml.safe_load(kubectl.plane.kubeconfig.read_text())
    config["contexts"][0]["context"]["namespace"] = namespace
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    assert [r["NAME"] for r in columns(plugin(kubectl, "get", "--kubeconfig", str(tmp_path / "kubeconfig")).stdout)] \
        == ["digits"]
    missing = plugin(kubectl, "get", "nosuch", *ns, check=False)
    assert missing.returncode == 1 and f"no DistBeliefJob 'nosuch' in namespace {namespace}" in missing.stderr

    # describe: why it runs, each shard's primary and copies (pods 0 and 2 hold shard 0, 1 and 3 shard 1),
    # the operator's Events about it.
    described = plugin(kubectl, "describe", "digits", *ns).stdout
    print(described)
    assert re.search(r"^Phase: +Running \(Training: 2 shards and 2 replicas ready\)$", described, re.M), described
    assert "Shards:        2, 2 copies each; 4/4 pods ready" in described
    for shard in (0, 1):
        assert re.search(rf"^  {shard} +digits-ps-{shard} +2 +0 +digits-ps-{shard} \(ready\), "
                         rf"digits-ps-{shard + 2} \(ready\)$", described, re.M), described
    assert re.search(r"^Checkpoint: +step \d+ at ", described, re.M), described
    posted = {e["reason"] for e in get(kubectl, "events", *ns, "--field-selector",
                                        "involvedObject.kind=DistBeliefJob")["items"]}
    assert "Running" in posted
    events = described.split("\nEvents:\n", 1)[1]
    assert {line.split()[1] for line in events.splitlines()[1:]} <= posted and "Running" in events, described

    # logs: by role, by shard, the chief's alone, and followed.
    chief = plugin(kubectl, "logs", "digits", "--role", "chief", *ns).stdout
    evaluated = [int(m) for m in re.findall(r"event=evaluated step=(\d+)", chief)]
    assert evaluated and "shard=0" in chief and "[" not in chief.splitlines()[0], chief[-2000:]
    workers = plugin(kubectl, "logs", "digits", "--role", "worker", *ns).stdout
    assert len({line.split("]")[0] for line in workers.splitlines()}) == 2, workers[-2000:]
    assert all(line.startswith("[digits-worker-") for line in workers.splitlines())
    shard = plugin(kubectl, "logs", "digits", "--shard", "1", *ns).stdout
    assert {line.split("]")[0] for line in shard.splitlines()} == {"[digits-ps-1", "[digits-ps-3"}
    assert "shard=1" in shard and "shard=0" not in shard and "event=evaluated" not in shard
    assert _follows(kubectl, namespace, after=max(evaluated))

    # top: every pod's step rate, memory and traffic, from its metrics endpoint.
    through_node = {"DISTBELIEF_METRICS_URL": METRICS_URL.format(port=local_node.port)}
    def stepping() -> list[dict[str, str]]:  # every pod read and moving (a loaded machine may stall one)
        shown = plugin(kubectl, "top", "digits", "--interval", "1", *ns, env=through_node).stdout
        print(shown)
        rows = columns(shown)
        return rows if all(re.fullmatch(r"[\d.]+", r["STEPS/S"]) and float(r["STEPS/S"]) > 0 for r in rows) else []

    rows = eventually(stepping, 30, what="every pod stepping")
    assert sorted(r["ROLE"] for r in rows) == ["ps"] * 4 + ["worker"] * 2, rows
    assert all(r["MEMORY"].endswith("MiB") and r["IN"].endswith("iB") for r in rows), rows
    # By default through the API server's pod proxy, which refuses the node agent's loopback pod IPs:
    # each pod's refusal is named, and with no pod answering the exit code says so.
    proxied = plugin(kubectl, "top", "digits", "--interval", "0.1", *ns, check=False)
    assert proxied.returncode == 1 and proxied.stderr.count("address not allowed") == 6, proxied.stderr
    assert f"get metrics of pod {namespace}/digits-ps-0: 400" in proxied.stderr

    # scale: the API server's own refusal of a count the schema does not allow; then a real one.
    refused = plugin(kubectl, "scale", "digits", "1001", *ns, check=False)
    assert refused.returncode == 1 and "spec.workers.replicas" in refused.stderr and "1000" in refused.stderr, \
        refused.stderr
    plugin(kubectl, "scale", "digits", "3", *ns)
    assert get(kubectl, "dbj", "digits", *ns)["spec"]["workers"]["replicas"] == 3
    eventually(lambda: job_status(kubectl, namespace, "digits")["workers"]["ready"] == 3, 60, what="3 replicas")

    # suspend, then resume from the checkpoints.
    plugin(kubectl, "suspend", "digits", *ns)
    eventually(lambda: job_status(kubectl, namespace, "digits")["phase"] == "Suspended", 60, what="Suspended")
    assert "Phase:         Suspended (Suspended: runPolicy.suspend is true" in plugin(
        kubectl, "describe", "digits", *ns).stdout
    saved = job_status(kubectl, namespace, "digits")["lastCheckpoint"]["step"]
    plugin(kubectl, "resume", "digits", *ns)
    assert get(kubectl, "dbj", "digits", *ns)["spec"]["runPolicy"]["suspend"] is False
    resumed = running(kubectl, namespace)
    assert resumed["globalStep"] >= saved


def _follows(kubectl: Kubectl, namespace: str, *, after: int) -> bool:
    """`logs -f` on the chief prints an evaluation newer than `after` while it runs (within
    a minute: then the follower is stopped)."""
    args = ("logs", "digits", "--role", "chief", "-f", "-n", namespace)
    with subprocess.Popen(command(*args, kubectl=kubectl.binary), env=environment(kubectl.plane.env()),
                          stdout=subprocess.PIPE, text=True) as follower:
        deadline = threading.Timer(60, follower.terminate)
        deadline.start()
        try:
            assert follower.stdout is not None
            for line in follower.stdout:
                found = re.search(r"event=evaluated step=(\d+)", line)
                if found and int(found.group(1)) > after:
                    return True
        finally:
            deadline.cancel()
            follower.terminate()
    return False
