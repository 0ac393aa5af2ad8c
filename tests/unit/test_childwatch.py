"""The child watch's view of a job: the children a job's version wants, rendered once per
version, and none for a job whose spec the rules refuse (its children are left alone)."""

from __future__ import annotations

import copy

from distbelief.operator.cluster import childwatch
from support.examples import load_example


def stored(doc: dict, uid: str, version: str) -> dict:
    job = copy.deepcopy(doc)
    job["metadata"].update(namespace="ml", uid=uid, resourceVersion=version)
    return job


def test_a_valid_jobs_version_renders_its_children_once() -> None:
    job = stored(load_example("digits-mlp.yaml"), "u-valid", "1")
    first = childwatch._rendered(job)
    assert first is not None
    kinds = {child["kind"] for child in first[1]}
    assert {"StatefulSet", "Deployment", "ConfigMap"} <= kinds
    assert childwatch._rendered(job) is first


def test_a_job_the_rules_refuse_wants_no_children() -> None:
    broken = stored(load_example("digits-mlp.yaml"), "u-broken", "1")
    broken["spec"]["training"]["batchSize"] = 0
    assert childwatch._rendered(broken) is None
