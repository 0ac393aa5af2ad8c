"""The children's watch: a job's child that is deleted or changed is put back.

kopf watches every kind of child the operator applies, by the label the renderer gives
them all (app.kubernetes.io/managed-by), and calls put_back() for every change; an index
of the jobs tells cheaply whether the change made the child differ from what its job
wants. Level-triggered: the job's wish, not the change, decides what the child becomes.
The keys Secret is not watched: the operator may create Secrets, never read them.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Mapping

import kopf

from distbelief.operator import errors
from distbelief.operator.cluster import children, handlers, locks, observing
from distbelief.operator.cluster.kube import Kube
from distbelief.operator.render import kinds, podparts
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status.status import TERMINAL
from distbelief.runtime import contract

log = logging.getLogger(__name__)


@kopf.on.startup()
def select_children(settings: kopf.OperatorSettings, **_: Any) -> None:
    """The children are watched by their label on the server where kopf can say so (1.45 and
    later); older kopf lists every object of those kinds and the handlers' filter drops the rest."""
    selectors = getattr(settings.watching, "label_selectors", None)
    if selectors is not None:
        for group_version, plural in set(kinds.WATCHED_CHILDREN) | set(observing.WATCHED):   # the jobs' pods too
            selectors[group_version, plural] = ",".join(f"{k}={v}" for k, v in podparts.MANAGED.items())


@kopf.index(*handlers.RESOURCE)
def jobs(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """Every job as last seen, by (namespace, name): what a changed child is compared against."""
    return {(namespace, name): {**handlers.stored(body), "status": copy.deepcopy(dict(body.status or {}))}}


def put_back(type: str | None, body: kopf.Body, namespace: str, jobs: kopf.Index, **_: Any) -> None:
    """A child was changed or deleted: make it its job's again (level-triggered: the job's
    wish, not the change, decides). The job as last indexed tells cheaply whether the child
    drifted; only then is the job read afresh (the index may lag behind a spec change or a
    finish) and the child put back, unless the job is going or its spec is invalid."""
    owner = next((ref for ref in body.metadata.get("ownerReferences", []) if ref.get("controller")
                  and ref.get("kind") == contract.KIND), None)
    if not owner:
        return
    indexed: Mapping[str, Any] | None = next(iter(jobs.get((namespace, owner["name"]), [])), None)
    gone = type == "DELETED"
    if indexed is None or not _drifted(indexed, body, gone=gone):
        return
    kube = Kube()
    fresh = kube.get(contract.JOB_API_VERSION, contract.KIND, namespace, owner["name"])
    if fresh is None or fresh["metadata"]["uid"] != owner["uid"] or fresh["metadata"].get("deletionTimestamp"):
        return
    try:
        job = locks.locked_job(handlers.validated(fresh)).job
    except errors.SpecError:
        return
    finished = (fresh.get("status") or {}).get("phase") in TERMINAL
    result = children.put_back(kube, job, handlers.desired_children(job, finished=finished), dict(body),
                               gone=gone)
    if result:
        what = f"{body.get('kind')} {body.metadata.name}"
        log.info("event=child_put_back job=%s namespace=%s child=%r result=%s", job.config.name,
                 namespace, what, result)
        kopf.info(fresh, reason="ChildRestored",
                  message=f"{what} {'was deleted' if gone else 'differed from the job'}: {result}")


def _drifted(job: Mapping[str, Any], child: kopf.Body, *, gone: bool) -> bool:
    wanted = _rendered(job)
    return wanted is not None and children.drifted(wanted[0], wanted[1], dict(child), gone=gone)


# The children each indexed version of a job wants, by (uid, resourceVersion): every
# child's every event is compared against them, and a job's version renders once.
_RENDERED: dict[tuple[str, str], tuple[DistBeliefJob, list[dict[str, Any]]] | None] = {}
_RENDERED_MAX = 512


def _rendered(job: Mapping[str, Any]) -> tuple[DistBeliefJob, list[dict[str, Any]]] | None:
    """(the job validated, its children), or None for a job whose spec is invalid."""
    key = (job["metadata"].get("uid", ""), job["metadata"].get("resourceVersion", ""))
    if key not in _RENDERED:
        if len(_RENDERED) >= _RENDERED_MAX:
            _RENDERED.clear()
        try:
            valid = locks.locked_job(handlers.validated(job)).job
        except errors.SpecError:
            _RENDERED[key] = None
        else:
            finished = (job.get("status") or {}).get("phase") in TERMINAL
            _RENDERED[key] = (valid, handlers.desired_children(valid, finished=finished))
    return _RENDERED[key]


for _group_version, _plural in kinds.WATCHED_CHILDREN:
    kopf.on.event(_group_version, _plural, id=f"put_back/{_plural}",
                  labels=podparts.MANAGED)(put_back)
