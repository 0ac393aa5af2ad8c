"""A job in a Kueue queue, rendered: its Workload, and the placement an admission gives its pods."""

from __future__ import annotations

import copy
import datetime
import json
from typing import Any

from distbelief.operator import errors
from distbelief.operator.cluster import handlers
from distbelief.operator.render import queue, render
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status.status import Observed, compute_status

from support.examples import load_example

IMAGE = "registry.example/distbelief:test"


def queued(name: str = "digits-mlp.yaml", **annotations: str) -> dict[str, Any]:
    doc = copy.deepcopy(load_example(name))
    doc["metadata"].update(uid="uid-1", namespace="ml", labels={queue.QUEUE_LABEL: "team-a"},
                           annotations=annotations)
    return spec.validate_job(doc)


def workloads(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in children if c["kind"] in ("StatefulSet", "Deployment")}


def test_the_workload_asks_for_every_pod_of_the_job_with_its_requests() -> None:
    doc = queued("digits-partitioned.yaml")
    doc["spec"]["workers"].update(replicas=3, resources={"requests": {"cpu": "2"}})
    doc["spec"]["workers"]["template"] = {"spec": {"priorityClassName": "high"}}
    workload = render.render_workload(DistBeliefJob.of(doc), image=IMAGE)
    assert workload["apiVersion"] == "kueue.x-k8s.io/v1beta1"
    assert workload["spec"]["queueName"] == "team-a"
    assert workload["spec"]["priorityClassName"] == "high"
    sets = {s["name"]: s for s in workload["spec"]["podSets"]}
    shards = doc["spec"]["parameterServers"]["shards"]
    assert (sets["ps"]["count"], sets["worker"]["count"]) == (shards, 3 * doc["spec"]["model"]["partitions"])
    assert sets["worker"]["template"]["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "2"}
    assert workload["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_a_queued_job_not_yet_admitted_renders_no_pods_even_unsuspended() -> None:
    doc = queued()
    assert doc["spec"]["runPolicy"]["suspend"] is False
    for child in workloads(handlers.desired_children(DistBeliefJob.of(doc), finished=False)).values():
        assert child["spec"]["replicas"] == 0, child["metadata"]["name"]


def test_an_admitted_job_runs_its_pods_where_the_admission_placed_them() -> None:
    placement = {"ps": {"nodeSelector": {"pool": "highmem"}, "tolerations": []},
                 "worker": {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}}
    doc = queued(**{queue.ADMISSION_ANNOTATION: json.dumps(placement)})
    doc["spec"]["workers"]["template"] = {"spec": {"nodeSelector": {"team": "ml"}}}
    children = workloads(handlers.desired_children(DistBeliefJob.of(doc), finished=False))
    ps, worker = children["digits-ps"]["spec"], children["digits-worker"]["spec"]
    assert ps["replicas"] > 0 and worker["replicas"] > 0
    assert ps["template"]["spec"]["nodeSelector"] == {"pool": "highmem"}
    assert worker["template"]["spec"]["nodeSelector"] == {"team": "ml", "pool": "gpu"}
    assert worker["template"]["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    # The Workload keeps the templates as they were before the admission.
    sets = {s["name"]: s for s in render.render_workload(DistBeliefJob.of(doc), image=IMAGE)["spec"]["podSets"]}
    assert sets["worker"]["template"]["spec"]["nodeSelector"] == {"team": "ml"}


def test_the_placement_unites_the_node_labels_and_tolerations_of_the_assigned_flavors() -> None:
    flavors = {"spot": {"spec": {"nodeLabels": {"lifecycle": "spot"},
                                 "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}},
               "a100": {"spec": {"nodeLabels": {"gpu": "a100"}}}}
    admission = {"podSetAssignments": [{"name": "ps", "flavors": {"cpu": "spot", "memory": "spot"}},
                                       {"name": "worker", "flavors": {"cpu": "spot", "nvidia.com/gpu": "a100"}}]}
    placement = queue.placement_of(admission, flavors)
    assert placement["ps"] == {"nodeSelector": {"lifecycle": "spot"},
                               "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}
    assert placement["worker"]["nodeSelector"] == {"gpu": "a100", "lifecycle": "spot"}
    assert len(placement["worker"]["tolerations"]) == 1



def test_an_admission_checks_pod_set_updates_add_to_the_flavors_placement() -> None:
    admission = {"podSetAssignments": [{"name": "worker", "flavors": {"cpu": "spot"}}, {"name": "ps", "flavors": {}}]}
    checks = [{"name": "provisioning", "podSetUpdates": [
        {"name": "worker", "nodeSelector": {"provisioned-by": "req-1"},
         "tolerations": [{"key": "provisioned", "operator": "Exists"}]}]}]
    placement = queue.placement_of(admission, {"spot": {"spec": {"nodeLabels": {"lifecycle": "spot"}}}}, checks)
    assert placement["worker"] == {"nodeSelector": {"lifecycle": "spot", "provisioned-by": "req-1"},
                                   "tolerations": [{"key": "provisioned", "operator": "Exists"}]}
    assert placement["ps"] == {"nodeSelector": {}, "tolerations": []}


class _NoKueue:
    """A cluster without Kueue's types: every call about a Workload is refused."""

    def get(self, *args: Any) -> None:
        raise errors.KubeError("get", "Workload ml/distbeliefjob-digits", 404, "Not Found")

    create = patch = get


def test_without_kueue_a_queued_job_stays_suspended_saying_why() -> None:
    doc = queued()
    hold = handlers.sync_queue(_NoKueue(), None, DistBeliefJob.of(doc), finished=False)  # type: ignore[arg-type]
    assert hold is not None and hold[0] == "QueueUnavailable" and "404" in hold[1]
    observed = Observed(queued=hold)
    status = compute_status(DistBeliefJob.of(doc), observed, datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc))
    suspended = next(c for c in status["conditions"] if c["type"] == "Suspended")
    assert (status["phase"], suspended["reason"]) == ("Suspended", "QueueUnavailable")
