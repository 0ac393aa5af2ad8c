"""The operator's own metrics on a real control plane: `distbelief operator --metrics`, as
the chart's ServiceAccount, scraped over HTTP while it reconciles jobs a user applies."""

from __future__ import annotations

import base64
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from distbelief.runtime import keys
from support.chiefs import Chiefs
from support.cluster import JOBS, WAIT, Api, Kubectl, Operator
from support.kubejobs import apply, kubelet_runs, new_job, phase_is, pods_of
from support.waiting import eventually

pytestmark = pytest.mark.floors  # prometheus_client's server and kopf's event handler at their floors too

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(operator: Operator) -> Samples:
    with urllib.request.urlopen(operator.metrics_url, timeout=5) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def reconciles(samples: Samples, outcome: str) -> float:
    return sample(samples, "distbelief_operator_reconciles_total", outcome=outcome) or 0.0


def phases(samples: Samples, namespace: str, job: str) -> set[str]:
    """The phases the per-job series show for the job (one, or none once it is gone)."""
    return {dict(labels)["phase"] for (name, labels) in samples if name == "distbelief_operator_job_phase"
            and ("namespace", namespace) in labels and ("distbelief_io_job", job) in labels}


def phase_shown(operator: Operator, namespace: str, job: str, phase: str) -> Samples | None:
    """A scrape that shows the job in phase, else None."""
    samples = scrape(operator)
    return samples if phases(samples, namespace, job) == {phase} else None


def test_a_reconciled_job_is_counted_and_its_phase_follows_it(operator: Operator, api: Api, kubectl: Kubectl,
                                                             chiefs: Chiefs, namespace: str) -> None:
    before = scrape(operator)
    apply(kubectl, namespace, new_job("counted"))
    api.wait(JOBS, namespace, "counted", phase_is("Pending"))
    pending = eventually(lambda: phase_shown(operator, namespace, "counted", "Pending"), WAIT, interval=0.2,
                         what="the job Pending in the operator's metrics")
    assert reconciles(pending, "applied") >= reconciles(before, "applied") + 1
    assert (sample(pending, "distbelief_operator_reconcile_seconds_count") or 0) > \
        (sample(before, "distbelief_operator_reconcile_seconds_count") or 0)
    assert (sample(pending, "distbelief_operator_jobs", phase="Pending") or 0) >= 1
    assert sample(pending, "process_resident_memory_bytes") > 0

    pods_of(api, namespace, "counted", 2, "ps")
    pods_of(api, namespace, "counted", 3, "worker")
    kubelet_runs(api, namespace, "counted")
    shard, _ = chiefs.of(namespace, "counted")
    shard.global_step.set(100)
    api.wait(JOBS, namespace, "counted", phase_is("Running"))
    running = eventually(lambda: phase_shown(operator, namespace, "counted", "Running"), WAIT, interval=0.2,
                         what="the job Running in the operator's metrics")
    assert (sample(running, "distbelief_operator_jobs", phase="Running") or 0) >= 1

    kubectl("delete", "dbj", "counted", "-n", namespace, "--wait=true", timeout=90)
    # (The error counter is not compared here: the session's operator also reconciles the
    # jobs of earlier tests, whose namespaces may still be going away; unit-tested instead.)
    eventually(lambda: not phases(scrape(operator), namespace, "counted"), WAIT, interval=0.2,
               what="the deleted job gone from the operator's metrics")


def test_a_refused_reconcile_counts_as_blocked_not_as_an_error(operator: Operator, api: Api, kubectl: Kubectl,
                                                               namespace: str) -> None:
    """A keys Secret the job did not make: reconcile() refuses for now, and kopf retries."""
    before = scrape(operator)
    api.create("v1/secrets", namespace, {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "refused-keys"},
        "data": {n: base64.b64encode(t.encode()).decode() for n, t in keys.JobKeys.generate().files().items()}})
    apply(kubectl, namespace, new_job("refused"))
    api.wait_event(namespace, "refused", "KeysSecretForeign")
    def counted_blocked() -> Samples | None:
        samples = scrape(operator)
        return samples if reconciles(samples, "blocked") > reconciles(before, "blocked") else None

    after = eventually(counted_blocked, WAIT, interval=0.2, what="a blocked reconcile counted")
    assert sample(after, "distbelief_operator_errors_total", handler="reconcile") == \
        sample(before, "distbelief_operator_errors_total", handler="reconcile")


def api_requests(samples: Samples, method: str, resource: str) -> float:
    return sample(samples, "distbelief_operator_api_requests_total", method=method, resource=resource) or 0.0


def test_status_passes_read_the_operators_watches_not_the_api_server(operator: Operator, api: Api, kubectl: Kubectl,
                                                                     chiefs: Chiefs, namespace: str) -> None:
    """A running job's status follows its pods and its chief pass after pass, while the
    operator's own client sends the API server no read of pods (cluster/observing.py: the
    passes read the watches kopf keeps; they once listed the job's pods every pass)."""
    before = scrape(operator)
    apply(kubectl, namespace, new_job("watched"))
    pods_of(api, namespace, "watched", 2, "ps")
    pods_of(api, namespace, "watched", 3, "worker")
    kubelet_runs(api, namespace, "watched")
    shard, _ = chiefs.of(namespace, "watched")
    for step in (100, 200, 300):        # a pass after each: the status shows the chief's step
        shard.global_step.set(step)
        api.wait(JOBS, namespace, "watched",
                 lambda job, s=step: job is not None and (job.get("status") or {}).get("globalStep") == s)
    running = api.wait(JOBS, namespace, "watched", phase_is("Running"))
    status = running["status"]
    assert status["parameterServers"]["ready"] == 2 and status["workers"] == {"replicas": 3, "ready": 3}
    after = scrape(operator)
    assert api_requests(after, "GET", "pods") == api_requests(before, "GET", "pods") == 0
