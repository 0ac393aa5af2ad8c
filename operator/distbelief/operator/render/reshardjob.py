"""The Job <job>-reshard: one pod that mounts the checkpoint claims of every shard pod of
either count and re-lays them for the new one (`distbelief reshard-claims`:
runtime/roles/reshard.py). The operator runs it once a changed shard count has stopped
the job's pods (cluster/resharding.py); its labels record both counts.

Its pod mounts every claim at once, so they must be mountable together: ReadWriteMany,
or ReadWriteOnce volumes that one node can reach (docs/guides/resharding.md).
"""

from __future__ import annotations

from typing import Any, Mapping

from distbelief.operator.render import podparts
from distbelief.operator.render.context import RenderContext
from distbelief.runtime import contract

Manifest = dict[str, Any]
ROLE = "reshard"
FROM_LABEL, TO_LABEL = f"{contract.API_GROUP}/reshard-from", f"{contract.API_GROUP}/reshard-to"
CLAIMS_DIR = "/var/lib/distbelief/claims"
TERMINATION_LOG = "/dev/termination-log"
# A reshard killed midway is finished by the next try (its folder protocol); a reshard
# that fails three times fails for a reason a retry does not fix (its pod says which).
BACKOFF_LIMIT = 2
# The reshard pod's memory limit, in old shards' limits: it reads every old shard's state
# (an embedding table's rows whole) and lays the new shards' beside it.
RESHARD_MEMORY = 2


def job_name(names: contract.JobNames) -> str:
    return f"{names.job}-{ROLE}"


def claim_name(names: contract.JobNames, pod: int) -> str:
    """The checkpoint claim the StatefulSet gives shard pod `pod` (from its claim template)."""
    return f"{contract.CHECKPOINT_VOLUME}-{names.shard_pod(pod)}"


def render_claim(ctx: RenderContext, pod: int) -> Manifest:
    """Shard pod `pod`'s claim, as the StatefulSet would make it: made before the pod exists,
    for the reshard to write its checkpoint into; the StatefulSet then adopts it."""
    claim = podparts.checkpoint_claim(ctx, ctx.spec.parameter_servers.checkpoint.storage)
    claim["metadata"] = {**claim["metadata"], "name": claim_name(ctx.names, pod), "namespace": ctx.config.namespace}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", **claim}


def _resources(shard: Mapping[str, Any], before: int) -> dict[str, Any]:
    """A shard's requests; and with a shard memory limit, a limit of RESHARD_MEMORY times the
    old shards' together: the reshard holds every old shard's state and the new shards'."""
    resources = {"requests": dict(shard["requests"])} if shard.get("requests") else {}
    limit = (shard.get("limits") or {}).get("memory")
    if limit is not None:
        resources["limits"] = {"memory": str(int(podparts.cpu_cores(limit) * RESHARD_MEMORY * before))}
    return resources


def render_reshard_job(ctx: RenderContext, before: int, after: int) -> Manifest:
    """The Job from `before` shards to `after`: its pod mounts the claims of every shard pod
    of either count (each shard's copies included), in pod order."""
    pods = max(before, after) * ctx.spec.parameter_servers.copies
    folders = [f"{CLAIMS_DIR}/{pod}" for pod in range(pods)]
    container: Manifest = {
        "name": ROLE,
        "image": ctx.image,
        "command": ["distbelief", "reshard-claims"],
        "args": [*folders, "--config", contract.CONFIG_PATH, "--shards", str(after),
                 "--message-file", TERMINATION_LOG],
        "env": [{"name": k, "value": v} for k, v in contract.ROLE_ENV.items()],
        "securityContext": podparts.container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": podparts.CONFIG_VOLUME, "mountPath": contract.CONFIG_DIR, "readOnly": True},
                         {"name": podparts.SCRATCH_VOLUME, "mountPath": contract.SCRATCH_DIR},
                         *({"name": f"claim-{pod}", "mountPath": folder} for pod, folder in enumerate(folders))],
    }
    resources = _resources(ctx.spec.parameter_servers.resources or {}, before)
    if resources:
        container["resources"] = resources
    metadata = podparts.metadata(ctx, job_name(ctx.names), ROLE)
    metadata["labels"].update({FROM_LABEL: str(before), TO_LABEL: str(after)})
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "template": {
                "metadata": {"labels": podparts.labels(ctx.config.name, ROLE)},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": podparts.pod_security(),
                    "containers": [container],
                    "volumes": [{"name": podparts.CONFIG_VOLUME, "configMap": {"name": ctx.names.config_map}},
                                {"name": podparts.SCRATCH_VOLUME, "emptyDir": {}},
                                *({"name": f"claim-{pod}", "persistentVolumeClaim": {"claimName": claim_name(ctx.names, pod)}}
                                  for pod in range(pods))],
                },
            },
        },
    }
