"""What the pods may do on a real node: a job's shard and replica, and the chart's operator,
run as uid 10001 with no capability and no_new_privs, on a read-only root filesystem:
`kubectl exec` into each running container finds that it can write to its writable volumes
(emptyDir /tmp, the shard's checkpoint claim) and nowhere else."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from support import nodejobs
from support.cluster import Kubectl
from support.paths import EXAMPLES
from support.waiting import eventually

pytestmark = pytest.mark.timeout(3600)

# Run in the container (python -c): tries to create a file in each folder and to append to
# each file; prints what happened (written, or the errno's name), which of them the process
# could write to by their owner and mode alone, and the process's identity.
PROBE = """
import errno, json, os, stat, sys
writes, permitted = {}, []
for path in json.loads(sys.argv[1]):
    st = os.stat(path)
    if st.st_mode & stat.S_IWOTH or (st.st_uid == os.getuid() and st.st_mode & stat.S_IWUSR):
        permitted.append(path)
    target = path if os.path.isfile(path) else os.path.join(path, ".write-probe")
    try:
        with open(target, "a") as f:
            f.write("")
        if target != path:
            os.unlink(target)
        writes[path] = "written"
    except OSError as e:
        writes[path] = errno.errorcode.get(e.errno, str(e.errno))
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
print(json.dumps({"writes": writes, "permitted": permitted, "uid": os.getuid(), "gid": os.getgid(),
                  "CapEff": status["CapEff"].strip(), "NoNewPrivs": status["NoNewPrivs"].strip()}))
"""
# Folders and files of the image's root filesystem. /var/tmp is world-writable (mode 1777, as
# in every Debian): only the read-only root filesystem keeps the pod from writing there.
ROOT_FS = ["/", "/opt/distbelief", "/opt/distbelief/bin", "/usr/local/lib", "/etc", "/var", "/var/tmp", "/root",
           "/etc/passwd"]


def probe(kubectl: Kubectl, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    out = kubectl("exec", "-n", namespace, pod["metadata"]["name"], "-c", container["name"], "--",
                  "python", "-c", PROBE, json.dumps(ROOT_FS + sorted(mounts)))
    report = json.loads(out.strip().splitlines()[-1])
    report["volumes"] = {}
    for path, mount in mounts.items():
        volume = volumes[mount["name"]]
        writable = not mount.get("readOnly") and ("emptyDir" in volume or "persistentVolumeClaim" in volume)
        report["volumes"][path] = "written" if writable else "EROFS"   # a read-only mount: EROFS
    return report


def assert_confined(name: str, report: dict[str, Any]) -> None:
    writes = report["writes"]
    # The root filesystem: nothing written; EROFS where owner and mode would let the process
    # write (/var/tmp), EROFS or EACCES elsewhere (the kernel checks permissions first).
    assert all(writes[p] in ("EROFS", "EACCES") for p in ROOT_FS), (name, report)
    assert "/var/tmp" in report["permitted"], (name, report)
    assert all(writes[p] == "EROFS" for p in ROOT_FS if p in report["permitted"]), (name, report)
    # The volumes: written to the writable ones (emptyDir, claims), not to the read-only ones.
    assert {p: writes[p] for p in report["volumes"]} == report["volumes"], (name, report)
    assert "written" in report["volumes"].values(), (name, report)   # /tmp at least
    assert (report["uid"], report["gid"]) == (10001, 10001), (name, report)
    assert int(report["CapEff"], 16) == 0, (name, report)
    assert report["NoNewPrivs"] == "1", (name, report)


def test_a_jobs_shard_and_replica_and_the_operator_write_only_to_their_volumes(
        kubectl: Kubectl, release: str, namespace: str) -> None:
    job = yaml.safe_load((EXAMPLES / "digits-mlp.yaml").read_text())
    job["metadata"]["name"] = "confined"
    job["spec"]["training"].update(maxSteps=10**9, maxDuration="15m")   # runs until deleted
    job["spec"]["workers"]["replicas"] = 1
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(job))

    def running() -> dict[str, dict[str, Any]] | None:
        pods = {p["metadata"]["labels"]["distbelief.io/role"]: p
                for p in nodejobs.job_pods(kubectl, namespace, "confined")
                if p["metadata"]["name"] == "confined-ps-0" or "worker" in p["metadata"]["name"]}
        ready = all(c.get("ready") for p in pods.values() for c in p["status"].get("containerStatuses", [{}]))
        return pods if len(pods) == 2 and ready else None

    try:
        pods = eventually(running, 900, interval=2, what="the shard and the replica running and ready")
    except AssertionError:
        print(nodejobs.diagnostics(kubectl, namespace, release))
        raise
    (operator,) = kubectl.json("get", "pods", "-n", release, "-l", "app.kubernetes.io/name=distbelief")["items"]
    reports = {role: probe(kubectl, namespace, pod) for role, pod in pods.items()}
    reports["operator"] = probe(kubectl, release, operator)
    kubectl("delete", "dbj", "confined", "-n", namespace, "--wait=false")
    for name, report in reports.items():
        assert_confined(name, report)
    assert reports["ps"]["writes"]["/var/lib/distbelief/checkpoints"] == "written"   # its claim
