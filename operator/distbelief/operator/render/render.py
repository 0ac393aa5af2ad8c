"""Render a validated DistBeliefJob into the Kubernetes objects that run it.

Pure functions: the output of :func:`distbelief.operator.validation.spec.validate_job` in, plain
manifest dicts out, no cluster access and no kopf or kubernetes imports. The operator
applies what these return, ``distbelief render`` prints it and local mode runs the
containers' commands, so there is exactly one renderer.

Children, in order: ConfigMap ``<job>-config`` (the resolved config), headless Service
``<job>-ps``, with backups the ServiceAccount, Role and RoleBinding ``<job>-ps`` (the
shard copies keep their view in Leases ``<job>-shard-<i>``), StatefulSet ``<job>-ps``
(one pod and one checkpoint volume per shard copy: pod o is copy o // shards of shard
o % shards), Deployment ``<job>-worker`` (the model replicas;
with spec.model.partitions N > 1, one Deployment ``<job>-worker-p<k>`` per partition
instead, each with spec.workers.replicas pods, so that a replica is one pod of each), the
PodDisruptionBudget ``<job>-ps`` (voluntary evictions take one shard pod at a time; local
mode has no use for it) and, when the spec asks, a HorizontalPodAutoscaler
``<job>-worker`` that scales the DistBeliefJob itself through its scale subresource, and,
unless the spec turns it off, the NetworkPolicy ``<job>-ps`` around all the job's pods.

Every pod mounts the Secret ``<job>-keys`` (the job's CurveZMQ keys) read-only. That
Secret is not among the children: it holds key material that must be made once and
never rewritten, so the operator creates it from :func:`secret.render_keys_secret` only when it
is absent, and local mode writes the same files into its output folder.

Each kind has a module of its own here (configmap, service, access, statefulset, deployment,
disruption, hpa, networkpolicy, secret); this one puts them in order, and writes YAML.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from distbelief.operator.render import (access, configmap, deployment, disruption, hpa, networkpolicy, podparts, queue,
                                        service, statefulset)
from distbelief.operator.render.context import RenderContext
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract

log = logging.getLogger(__name__)
Manifest = podparts.Manifest


def render_children(job: DistBeliefJob, *, image: str, finished: bool = False, held: bool = False,
                    operator_namespace: str | None = None) -> list[Manifest]:
    """Every child object of ``job``, in the order they should be applied.

    A finished job keeps its objects but runs no replicas (and no shards, unless
    runPolicy.cleanPodPolicy is None) and no autoscaler; nor does one its queue holds.
    operator_namespace is where the operator that reads the job's metrics runs (the
    NetworkPolicy admits it)."""
    ctx = RenderContext.of(job, image=image, finished=finished, held=held, operator_namespace=operator_namespace)
    children = [
        configmap.render_config_map(ctx),
        service.render_ps_service(ctx),
        *access.render_ps_access(ctx),
        statefulset.render_ps_statefulset(ctx),
        *deployment.render_worker_deployments(ctx),
        disruption.render_ps_disruption_budget(ctx),
    ]
    children += [c for c in (hpa.render_worker_hpa(ctx), networkpolicy.render_ps_network_policy(ctx)) if c is not None]
    log.debug("rendered job=%s children=%d hash=%s", ctx.config.name, len(children),
              ctx.config_hash)
    return children


def to_yaml(objs: Iterable[Mapping[str, Any]]) -> str:
    """Multi-document YAML, keys in the order they were built, multi-line text as blocks."""
    return yaml.dump_all([_plain(o) for o in objs], Dumper=_BlockDumper, sort_keys=False,
                         explicit_start=True, default_flow_style=False, allow_unicode=True)


def render_workload(job: DistBeliefJob, *, image: str) -> Manifest:
    """The Kueue Workload of a job labelled with a queue (render/queue.py): its podSets carry
    the roles' pod templates as the job runs them before any admission."""
    ctx = RenderContext.of(dataclasses.replace(job, annotations={}), image=image)
    first_partition = deployment.worker_partitions(ctx.config)[0]
    templates = {contract.ROLE_PS: statefulset.render_ps_statefulset(ctx)["spec"]["template"],
                 contract.ROLE_WORKER: deployment.render_worker_deployment(ctx, first_partition)["spec"]["template"]}
    return queue.render_workload(job, ctx, templates)


# ------------------------------------------------------------------------- YAML


class _BlockDumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings (the config JSON) as literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_BlockDumper.add_representer(str, _represent_str)


def _plain(obj: Any) -> Any:
    """A JSON round trip: plain dicts and lists only, whatever mappings came in."""
    return json.loads(json.dumps(obj))
