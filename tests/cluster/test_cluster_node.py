"""tools/local-node on a real control plane: the Node and its Lease, pods run as processes
with the status a kubelet writes, restarts, deletion, Deployments and StatefulSets with
their volume claims; and DistBeliefJobs that train to Succeeded through the real
StatefulSet and Deployment controllers, with the operator running beside it."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from distbelief.operator.render import podparts
from support.cluster import Kubectl
from support.kubejobs import restored_steps
from support.localnode import (LocalNode, apply, chart, example, finished, get, job_status,  # noqa: F401 (fixtures)
                               local_node, operator)
from support.paths import REPO
from support.waiting import eventually



def pod(name: str, code: str, *, restart: str = "Never", **container: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 5,
                     "containers": [{"name": "main", "image": "python", "command": ["python3", "-c", code],
                                     **container}]}}


def container_status(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    found = get(kubectl, "pod", name, "-n", namespace) or {}
    return ((found.get("status") or {}).get("containerStatuses") or [{}])[0]


def phase(kubectl: Kubectl, namespace: str, name: str) -> str | None:
    return ((get(kubectl, "pod", name, "-n", namespace) or {}).get("status") or {}).get("phase")


def pid_of(status: dict[str, Any]) -> int:
    return int(status["containerID"].removeprefix("local-node://"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------- the Node

def test_the_node_is_ready_with_capacity_and_keeps_its_lease_and_heartbeat_fresh(
        kubectl: Kubectl, local_node: LocalNode) -> None:
    node = get(kubectl, "node", local_node.name)
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == local_node.name
    assert {"cpu", "memory", "pods"} <= node["status"]["allocatable"].keys()
    assert {"type": "InternalIP", "address": "127.0.0.1"} in node["status"]["addresses"]

    def heartbeats() -> tuple[str, str]:
        lease = get(kubectl, "lease", local_node.name, "-n", "kube-node-lease")
        ready = next(c for c in get(kubectl, "node", local_node.name)["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True"
        return lease["spec"]["renewTime"], ready["lastHeartbeatTime"]

    first = heartbeats()
    assert get(kubectl, "lease", local_node.name, "-n", "kube-node-lease")["spec"]["holderIdentity"] == local_node.name
    eventually(lambda: all(a != b for a, b in zip(heartbeats(), first)), 20, what="the Lease and Ready renewed")


# ---------------------------------------------------------------- pods

@pytest.mark.parametrize("code, exit_code, message, policy", [
    ("import sys, time; print('working'); time.sleep(1.5); print('giving up'); sys.exit(3)", 3,
     "working\ngiving up", "FallbackToLogsOnError"),
    ("import time; time.sleep(1.5); open('/dev/termination-log', 'w').write('all done')", 0, "all done", "File"),
], ids=["failed", "succeeded"])
def test_a_pod_runs_then_ends_with_its_exit_code_and_termination_message(
        kubectl: Kubectl, local_node: LocalNode, namespace: str, code: str, exit_code: int, message: str,
        policy: str) -> None:
    apply(kubectl, namespace, pod("once", code, terminationMessagePolicy=policy))
    running = eventually(lambda: container_status(kubectl, namespace, "once").get("state", {}).get("running"), 30,
                         interval=0.1, what="the container running")
    assert running["startedAt"]
    done = eventually(lambda: phase(kubectl, namespace, "once") in ("Succeeded", "Failed")
                      and get(kubectl, "pod", "once", "-n", namespace), 30)
    assert done["status"]["phase"] == ("Succeeded" if exit_code == 0 else "Failed")
    assert done["status"]["podIP"].startswith("127.") and done["status"]["podIP"] != "127.0.0.1"
    assert done["status"]["startTime"]
    ended = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert ended["exitCode"] == exit_code
    assert ended["reason"] == ("Completed" if exit_code == 0 else "Error")
    assert ended["message"] == message
    conditions = {c["type"]: c["status"] for c in done["status"]["conditions"]}
    assert conditions == {"PodScheduled": "True", "PodReadyToStartContainers": "True", "Initialized": "True",
                          "ContainersReady": "False", "Ready": "False"}


def test_a_crash_looping_pod_is_restarted_with_back_off(kubectl: Kubectl, local_node: LocalNode,
                                                         namespace: str) -> None:
    apply(kubectl, namespace, pod("crash", "import sys; print('oops'); sys.exit(7)", restart="Always",
                                  terminationMessagePolicy="FallbackToLogsOnError"))
    looping = eventually(lambda: (s := container_status(kubectl, namespace, "crash")).get("restartCount", 0) >= 2
                         and s, 60, what="two restarts")
    assert looping["lastState"]["terminated"]["exitCode"] == 7
    assert looping["lastState"]["terminated"]["message"] == "oops"
    eventually(lambda: container_status(kubectl, namespace, "crash").get("state", {}).get("waiting", {})
               .get("reason") == "CrashLoopBackOff", 30, interval=0.1)
    assert phase(kubectl, namespace, "crash") == "Running"


def test_a_pod_with_restart_policy_on_failure_is_not_restarted_after_success(
        kubectl: Kubectl, local_node: LocalNode, namespace: str) -> None:
    apply(kubectl, namespace, pod("fine", "print('ok')", restart="OnFailure"))
    eventually(lambda: phase(kubectl, namespace, "fine") == "Succeeded", 30)
    assert container_status(kubectl, namespace, "fine")["restartCount"] == 0


@pytest.mark.parametrize("ignores_sigterm", [False, True], ids=["stops-on-sigterm", "killed-after-grace"])
def test_deleting_a_pod_stops_its_process_and_the_pod_goes(kubectl: Kubectl, local_node: LocalNode,
                                                           namespace: str, ignores_sigterm: bool) -> None:
    code = "import signal, time\nif IGNORE: signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\n" \
           "time.sleep(1e6)".replace("IGNORE", str(ignores_sigterm))
    doc = pod("sleeper", code, restart="Always")
    doc["spec"]["terminationGracePeriodSeconds"] = 2
    apply(kubectl, namespace, doc)
    running = eventually(lambda: (s := container_status(kubectl, namespace, "sleeper")).get("state", {})
                         .get("running") and s, 30)
    pid = pid_of(running)
    assert alive(pid)
    kubectl("delete", "pod", "sleeper", "-n", namespace, "--wait=false")
    eventually(lambda: get(kubectl, "pod", "sleeper", "-n", namespace) is None, 30, what="the pod deleted")
    assert not alive(pid)


def test_kubectl_logs_reads_a_containers_log_through_the_api_server(kubectl: Kubectl, local_node: LocalNode,
                                                                     namespace: str) -> None:
    apply(kubectl, namespace, pod("talker", "import time\nfor i in range(3):\n    print('line', i, flush=True)\n"
                                            "    time.sleep(0.5)"))
    eventually(lambda: phase(kubectl, namespace, "talker") in ("Running", "Succeeded"), 30)
    followed = kubectl("logs", "-f", "talker", "-n", namespace, timeout=60)  # until the container ends
    assert followed.splitlines() == ["line 0", "line 1", "line 2"]
    assert kubectl("logs", "talker", "-n", namespace, "--tail=1").splitlines() == ["line 2"]


def test_memory_limits_are_held_as_a_cluster_holds_them(kubectl: Kubectl, local_node: LocalNode,
                                                        namespace: str) -> None:
    grow = "import time\nblocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n    time.sleep(0.05)"
    apply(kubectl, namespace, pod("greedy", grow, resources={"limits": {"memory": "96Mi"}}))
    eventually(lambda: phase(kubectl, namespace, "greedy") == "Failed", 60)
    ended = container_status(kubectl, namespace, "greedy")["state"]["terminated"]
    assert (ended["exitCode"], ended["reason"]) == (137, "OOMKilled")


def test_volumes_environment_and_the_downward_api(kubectl: Kubectl, local_node: LocalNode, namespace: str) -> None:
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"},
              "data": {"greeting": "hello", "colour": "blue"}}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "token"}, "stringData": {"value": "s3cret"}}
    code = ("import os, sys, json\nfiles = {p: open(p).read() for p in sys.argv[1:]}\n"
            "print(json.dumps({'files': files, 'env': {k: os.environ[k] for k in "
            "('GREETING', 'WHO', 'POD_IP', 'MY_NAME', 'TOKEN', 'MEMORY')}}), file=open('/dev/termination-log', 'w'))")
    doc = pod("reader", code, args=["/etc/settings/greeting", "/etc/token/value"],
              env=[{"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}}},
                   {"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                   {"name": "WHO", "value": "$(GREETING), $(MY_NAME)"},
                   {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                   {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "token", "key": "value"}}},
                   {"name": "MEMORY", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory",
                                                                         "divisor": "1Mi"}}}],
              resources={"limits": {"memory": "200Mi"}},
              volumeMounts=[{"name": "settings", "mountPath": "/etc/settings"},
                            {"name": "token", "mountPath": "/etc/token"}])
    doc["spec"]["volumes"] = [{"name": "settings", "configMap": {"name": "settings"}},
                              {"name": "token", "secret": {"secretName": "token"}}]
    apply(kubectl, namespace, config, secret, doc)
    eventually(lambda: phase(kubectl, namespace, "reader") == "Succeeded", 30)
    seen = json.loads(container_status(kubectl, namespace, "reader")["state"]["terminated"]["message"])
    assert list(seen["files"].values()) == ["hello", "s3cret"]
    assert seen["env"] == {"GREETING": "hello", "WHO": "hello, reader", "MY_NAME": "reader", "TOKEN": "s3cret",
                           "MEMORY": "200", "POD_IP": get(kubectl, "pod", "reader", "-n", namespace)["status"]["podIP"]}


WHOAMI = """import json, os, ssl, sys, urllib.request
root = sys.argv[1]
token = open(os.path.join(root, 'token')).read()
context = ssl.create_default_context(cafile=os.path.join(root, 'ca.crt'))
url = 'https://%s:%s/apis/authentication.k8s.io/v1/selfsubjectreviews' % (
    os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT'])
body = json.dumps({'apiVersion': 'authentication.k8s.io/v1', 'kind': 'SelfSubjectReview'}).encode()
request = urllib.request.Request(url, data=body, method='POST', headers={
    'Authorization': 'Bearer ' + token, 'Content-Type': 'application/json'})
answer = json.load(urllib.request.urlopen(request, context=context))
print(json.dumps({'user': answer['status']['userInfo']['username'],
                  'namespace': open(os.path.join(root, 'namespace')).read()}), file=open('/dev/termination-log', 'w'))
"""


def test_a_projected_service_account_token_lets_the_pod_call_the_api_as_its_account(
        kubectl: Kubectl, local_node: LocalNode, namespace: str) -> None:
    """The volume the operator gives the shard copies (their view Leases): a bound token,
    the cluster's CA and the namespace, and the API server's address in the environment."""
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader-sa"}}
    mount = "/var/run/secrets/kubernetes.io/serviceaccount"
    doc = pod("whoami", WHOAMI, args=[mount], volumeMounts=[{"name": podparts.ACCOUNT_TOKEN_VOLUME,
                                                              "mountPath": mount, "readOnly": True}])
    doc["spec"].update(serviceAccountName="reader-sa", automountServiceAccountToken=False,
                       volumes=[podparts.account_token_volume()])
    apply(kubectl, namespace, account, doc)
    eventually(lambda: phase(kubectl, namespace, "whoami") in ("Succeeded", "Failed"), 30)
    seen = json.loads(container_status(kubectl, namespace, "whoami")["state"]["terminated"]["message"])
    assert seen == {"user": f"system:serviceaccount:{namespace}:reader-sa", "namespace": namespace}


# ---------------------------------------------------------------- workloads

SERVE = "import http.server, os\nhttp.server.HTTPServer((os.environ['POD_IP'], 8080), " \
        "http.server.SimpleHTTPRequestHandler).serve_forever()"


def test_a_deployments_pods_run_each_on_its_own_ip_and_become_ready(
        kubectl: Kubectl, local_node: LocalNode, namespace: str) -> None:
    template = pod("web", SERVE, restart="Always", ports=[{"name": "http", "containerPort": 8080}],
                   env=[{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                   readinessProbe={"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1})
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
                  "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                           "template": {"metadata": {"labels": {"app": "web"}}, "spec": template["spec"]}}}
    apply(kubectl, namespace, deployment)
    eventually(lambda: (get(kubectl, "deployment", "web", "-n", namespace)["status"].get("readyReplicas") == 2), 60,
               what="2 ready replicas")
    pods = get(kubectl, "pods", "-n", namespace, "-l", "app=web")["items"]
    assert len({p["status"]["podIP"] for p in pods}) == 2  # the same port 8080, two addresses
    name = pods[0]["metadata"]["name"]
    url = f"http://127.0.0.1:{local_node.port}/api/v1/namespaces/{namespace}/pods/{name}:8080/proxy/"
    with urllib.request.urlopen(url, timeout=10) as answer:  # the node's endpoint reaches a pod by name
        assert answer.status == 200
    kubectl("scale", "deployment", "web", "-n", namespace, "--replicas=0")
    eventually(lambda: not get(kubectl, "pods", "-n", namespace, "-l", "app=web")["items"], 60, what="scaled to 0")


def test_a_statefulset_gets_its_claims_bound_and_its_pods_run(kubectl: Kubectl, local_node: LocalNode,
                                                              namespace: str) -> None:
    write = "import os, sys, time\nopen(sys.argv[1], 'w').write(os.environ['NAME'])\ntime.sleep(1e6)"
    template = pod("store", write, restart="Always", args=["/data/owner"],
                   env=[{"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                   volumeMounts=[{"name": "data", "mountPath": "/data"}])
    claim = {"metadata": {"name": "data"},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}
    statefulset = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "store"},
                   "spec": {"replicas": 2, "serviceName": "store", "selector": {"matchLabels": {"app": "store"}},
                            "template": {"metadata": {"labels": {"app": "store"}}, "spec": template["spec"]},
                            "volumeClaimTemplates": [claim]}}
    apply(kubectl, namespace, statefulset)
    eventually(lambda: get(kubectl, "statefulset", "store", "-n", namespace)["status"].get("readyReplicas") == 2, 60)
    for ordinal in range(2):
        claim_now = get(kubectl, "pvc", f"data-store-{ordinal}", "-n", namespace)
        assert claim_now["status"]["phase"] == "Bound"
        volume = get(kubectl, "pv", claim_now["spec"]["volumeName"])
        folder = Path(volume["spec"]["local"]["path"])
        assert folder.is_relative_to(local_node.root)
        eventually((folder / "owner").exists, 10)
        assert (folder / "owner").read_text() == f"store-{ordinal}"
    kubectl("delete", "statefulset", "store", "-n", namespace, "--wait=false")
    eventually(lambda: not get(kubectl, "pods", "-n", namespace, "-l", "app=store")["items"], 60)
    kubectl("delete", "pvc", "--all", "-n", namespace, "--wait=false")
    eventually(lambda: not folder.exists(), 30, what="the released volume's folder deleted")


# ---------------------------------------------------------------- DistBeliefJobs end to end

def assert_trained(kubectl: Kubectl, namespace: str, status: dict[str, Any], job: dict[str, Any]) -> None:
    assert status["phase"] == "Succeeded", status
    assert status["globalStep"] >= job["spec"]["training"]["maxSteps"]
    assert status["accuracy"] > 0.8
    claims = get(kubectl, "pvc", "-n", namespace)["items"]
    assert {c["status"]["phase"] for c in claims} == {"Bound"}
    shards = job["spec"]["parameterServers"]
    assert len(claims) == shards["shards"] * (1 + shards.get("backups", 0))


@pytest.mark.slow
def test_the_digits_example_trains_to_succeeded_through_the_real_controllers(
        kubectl: Kubectl, local_node: LocalNode, namespace: str, operator: Path) -> None:
    path = REPO / "examples" / "digits-mlp.yaml"
    since = time.monotonic()
    kubectl("apply", "-n", namespace, "-f", str(path))
    status = finished(kubectl, namespace, "digits", operator, since)
    assert_trained(kubectl, namespace, status, yaml.safe_load(path.read_text()))


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [1, 4])
def test_a_partitioned_job_trains_to_succeeded(kubectl: Kubectl, local_node: LocalNode, namespace: str,
                                               operator: Path, micro_batches: int) -> None:
    job = example("digits-partitioned.yaml", model__microBatches=micro_batches)
    since = time.monotonic()
    apply(kubectl, namespace, job)
    assert_trained(kubectl, namespace, finished(kubectl, namespace, job["metadata"]["name"], operator, since), job)


@pytest.mark.slow
def test_a_running_job_resharded_from_2_to_3_shards_resumes_at_its_step_and_trains_to_succeeded(
        kubectl: Kubectl, local_node: LocalNode, namespace: str, operator: Path) -> None:
    """spec.parameterServers.shards changed while the job trains: the operator stops its
    pods, the reshard Job (`distbelief reshard-claims`, run by the node) re-lays the two
    claims over three, and each of the three shards restores the re-laid checkpoint at the
    step the reshard was made at; the job trains on to Succeeded."""
    job = example("digits-mlp.yaml", training__maxSteps=4000, training__maxDuration="5m")
    name = job["metadata"]["name"]
    since = time.monotonic()
    apply(kubectl, namespace, job)
    eventually(lambda: (job_status(kubectl, namespace, name).get("globalStep") or 0) > 500, 90, interval=0.3,
               what="training under way")
    kubectl("patch", "dbj", name, "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"parameterServers": {"shards": 3}}}))

    def reshard_ended() -> dict[str, Any] | None:
        return next((c for c in job_status(kubectl, namespace, name).get("conditions", [])
                     if c["type"] == "Resharding" and c["reason"] in ("Resharded", "ReshardFailed")), None)

    ended = eventually(reshard_ended, 180, interval=0.5, what="the reshard ended")
    match = re.fullmatch(r"resharded from 2 to 3 shards at step (\d+)", ended["message"])
    assert ended["reason"] == "Resharded" and match and int(match.group(1)) > 500, (
        ended, local_node.pod_lines(namespace, "event=checkpoint", "event=restored", "event=resharded", "event=listening",
                                    "ERROR", "Error"))
    for shard in range(3):
        restored = eventually(partial(restored_steps, kubectl, namespace, f"{name}-ps-{shard}"), 60, interval=0.5,
                              what=f"shard {shard} restored its checkpoint")
        assert restored == [int(match.group(1))], (shard, restored)
    status = finished(kubectl, namespace, name, operator, since)
    job["spec"]["parameterServers"]["shards"] = 3
    assert_trained(kubectl, namespace, status, job)
    assert not get(kubectl, "job", f"{name}-reshard", "-n", namespace)


def sigkill_once_training(kubectl: Kubectl, namespace: str, name: str, pod: str, *, past_step: int) -> None:
    """SIGKILL pod's process once the job is past_step, and wait for its container to restart (exit 137)."""
    eventually(lambda: (job_status(kubectl, namespace, name).get("globalStep") or 0) > past_step, 90, interval=0.3,
               what="training under way")
    os.kill(pid_of(container_status(kubectl, namespace, pod)), signal.SIGKILL)
    restarted = eventually(lambda: (s := container_status(kubectl, namespace, pod)).get("restartCount", 0) >= 1
                           and s, 60, what="the shard restarted")
    assert restarted["lastState"]["terminated"]["exitCode"] == 137


@pytest.mark.slow
def test_a_shard_killed_with_sigkill_is_restarted_and_counted_and_its_backup_carries_the_job(
        kubectl: Kubectl, local_node: LocalNode, namespace: str, operator: Path) -> None:
    job = example("digits-mlp.yaml", parameterServers__backups=1, training__maxSteps=6000)
    since = time.monotonic()
    apply(kubectl, namespace, job)
    name = job["metadata"]["name"]
    shard = f"{name}-ps-0"  # copy 0 of shard 0: the primary
    sigkill_once_training(kubectl, namespace, name, shard, past_step=200)
    status = finished(kubectl, namespace, name, operator, since)
    assert_trained(kubectl, namespace, status, job)
    assert status["restarts"] >= 1


@pytest.mark.slow
def test_a_shard_without_backups_sigkilled_replays_its_journal_and_the_job_loses_nothing(
        kubectl: Kubectl, local_node: LocalNode, namespace: str, operator: Path) -> None:
    """spec.parameterServers.journal through the CRD's defaults, the rendered config and
    the shard's claim: shard 1, SIGKILLed with no checkpoint written, comes back from its
    journal, and the job, which fails on any update lost, succeeds."""
    job = example("digits-mlp.yaml", parameterServers__journal=True, parameterServers__checkpoint={"everySeconds": 3600},
                  training__maxSteps=6000, training__failOnUpdatesLost=True)
    since = time.monotonic()
    apply(kubectl, namespace, job)
    name = job["metadata"]["name"]
    shard = f"{name}-ps-1"       # not the chief's pod
    sigkill_once_training(kubectl, namespace, name, shard, past_step=1000)
    status = finished(kubectl, namespace, name, operator, since)
    assert_trained(kubectl, namespace, status, job)
    assert not [c for c in status.get("conditions", []) if c["type"] == "UpdatesLost"], status


@pytest.mark.slow
def test_a_collapsed_job_succeeds_with_the_condition_and_the_warning_event_model_degraded(
        kubectl: Kubectl, local_node: LocalNode, namespace: str, operator: Path) -> None:
    # Plain SGD at rate 2 sends the digits model to chance within a second (tests/test_quality.py).
    job = example("digits-mlp.yaml", training__optimizer="sgd", training__learningRate=2.0, training__maxSteps=600)
    since = time.monotonic()
    apply(kubectl, namespace, job)
    status = finished(kubectl, namespace, "digits", operator, since)
    assert status["phase"] == "Succeeded"
    (degraded,) = [c for c in status["conditions"] if c["type"] == "ModelDegraded"]
    assert degraded["status"] == "True" and degraded["reason"] in ("HeldOutAtChance", "HeldOutFellFromBest")
    assert degraded["message"].startswith("held-out accuracy ended at ")
    events = eventually(lambda: [e for e in get(kubectl, "events", "-n", namespace)["items"]
                                 if e.get("reason") == "ModelDegraded"], 30, what="the ModelDegraded event")
    assert events[0]["type"] == "Warning" and events[0]["message"] == degraded["message"]
