"""Whether a job's keys Secret is its own when the create answers 409: the job as stored
decides when kopf hands over a body from before the job's record of its Secret (kopf runs
the create handler again on a stale body once it stops waiting for its own patch; issue
40 saw 562 of 1,000 healthy jobs refused as foreign that way)."""

from __future__ import annotations

from typing import Any

from distbelief.operator.cluster import handlers
from distbelief.operator.validation.job import DistBeliefJob

RECORD = handlers.KEYS_ANNOTATION


def job(annotations: dict[str, str] | None = None) -> DistBeliefJob:
    return DistBeliefJob.of({"metadata": {"name": "j", "namespace": "ml", "uid": "u-1",
                                          "annotations": annotations or {}},
                             "spec": {"data": {"source": "builtin:digits"}}})


class SecretTaken:
    """The API as the operator sees it when the job's keys Secret exists: the create answers
    409 (None), and the job reads as stored."""

    def __init__(self, stored: dict[str, Any] | None) -> None:
        self.stored, self.reads = stored, 0

    def create(self, desired: dict[str, Any]) -> dict[str, Any] | None:
        assert desired["kind"] == "Secret"
        return None

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        assert (kind, namespace, name) == ("DistBeliefJob", "ml", "j")
        self.reads += 1
        return self.stored


def test_a_body_with_the_record_is_own_without_a_read() -> None:
    kube = SecretTaken(None)
    assert handlers.ensure_keys_secret(kube, job({RECORD: "s-1"})) == "own"  # type: ignore[arg-type]
    assert kube.reads == 0


def test_a_stale_body_is_own_when_the_stored_job_has_the_record() -> None:
    kube = SecretTaken({"metadata": {"uid": "u-1", "annotations": {RECORD: "s-1"}}})
    assert handlers.ensure_keys_secret(kube, job()) == "own"  # type: ignore[arg-type]
    assert kube.reads == 1


def test_a_secret_the_job_never_recorded_is_foreign() -> None:
    for stored in ({"metadata": {"uid": "u-1", "annotations": {}}}, None,
                   {"metadata": {"uid": "another job of the name", "annotations": {RECORD: "s-9"}}}):
        assert handlers.ensure_keys_secret(SecretTaken(stored), job()) == "foreign"  # type: ignore[arg-type]
