"""A new job's check for an earlier job's checkpoint claims reads only the claims labelled
with its own name, never every claim of its namespace (issue 40: at 1,000 jobs in one
namespace that was 2,000 claims read for every new job)."""

from __future__ import annotations

from typing import Any, Mapping

from distbelief.operator.cluster import children
from distbelief.operator.validation.job import DistBeliefJob


def claim(name: str, job: str | None, uid: str | None = None) -> dict[str, Any]:
    labels = {"distbelief.io/role": "ps"}
    if job is not None:
        labels["distbelief.io/job"] = job
    if uid is not None:
        labels["distbelief.io/job-uid"] = uid
    return {"metadata": {"name": name, "namespace": "ml", "labels": labels}}


class Claims:
    """The namespace's claims, listed as the API server lists them by label; every list kept."""

    def __init__(self, *claims: dict[str, Any]) -> None:
        self.claims = list(claims)
        self.lists: list[Mapping[str, str]] = []

    def list(self, api_version: str, kind: str, namespace: str | None, selector: Mapping[str, str],
             fields: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        assert (api_version, kind, namespace) == ("v1", "PersistentVolumeClaim", "ml")
        self.lists.append(dict(selector))
        return [c for c in self.claims if all(c["metadata"]["labels"].get(k) == v for k, v in selector.items())]


def job(name: str, uid: str) -> DistBeliefJob:
    return DistBeliefJob.of({"metadata": {"name": name, "namespace": "ml", "uid": uid},
                             "spec": {"data": {"source": "builtin:digits"}}})


def test_only_the_claims_labelled_with_the_jobs_name_are_listed() -> None:
    kube = Claims(*[claim(f"checkpoints-other{i}-ps-0", f"other{i}", f"u{i}") for i in range(100)])
    assert children.stale_claims(kube, job("again", "new")) == []  # type: ignore[arg-type]
    assert kube.lists == [{"distbelief.io/job": "again"}]


def test_an_earlier_jobs_claims_are_stale_and_the_jobs_own_are_not() -> None:
    kube = Claims(claim("checkpoints-again-ps-1", "again", "old"), claim("checkpoints-again-ps-0", "again", "old"),
                  claim("checkpoints-again-ps-2", "again", "new"),       # the job's own
                  claim("checkpoints-again-ps-x", "again", "old"),       # not a shard's claim
                  claim("other-again-ps-0", "again", "old"))
    assert children.stale_claims(kube, job("again", "new")) == [  # type: ignore[arg-type]
        "checkpoints-again-ps-0", "checkpoints-again-ps-1"]


def test_a_claim_labelled_before_claims_carried_the_uid_is_stale_for_a_new_job() -> None:
    kube = Claims(claim("checkpoints-again-ps-0", "again"))
    assert children.stale_claims(kube, job("again", "new")) == ["checkpoints-again-ps-0"]  # type: ignore[arg-type]
