"""The rules of spec.parameterServers.template and spec.workers.template that a schema
cannot say: what the operator owns in a pod is refused, naming it.

The CRD says the same rules as CEL (x-kubernetes-validations) on the same paths, for the
API server; tests/cluster/test_cluster_validation.py shows the two agree. The renderer merges
what these rules let through onto the pods (render/placement.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distbelief.operator.validation.schemawalk import Problems, show
from distbelief.runtime import contract

ROLE_KEYS = {contract.ROLE_PS: "parameterServers", contract.ROLE_WORKER: "workers"}

# The labels every pod of a job carries, which the Services, StatefulSets, Deployments,
# PodDisruptionBudget and NetworkPolicy select by; distbelief.io/* are all the operator's.
OWNED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                "app.kubernetes.io/managed-by")
OWNED_PREFIX = f"{contract.API_GROUP}/"
OWNED_POD_FIELDS = ("securityContext", "hostNetwork", "automountServiceAccountToken", "initContainers")
OWNED_CONTAINER_FIELDS = ("command", "args", "image", "ports", "livenessProbe", "readinessProbe", "startupProbe",
                          "securityContext", "resources")
OWNED_ENV = ("POD_NAME", "POD_IP", "GLIBC_TUNABLES", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
             *contract.OBJECT_STORE_KEYS)
OWNED_ENV_PREFIX = "DISTBELIEF_"
OWNED_VOLUMES = ("config", "tmp", contract.KEYS_VOLUME, contract.CHECKPOINT_VOLUME, "data",
                 contract.SERVICE_ACCOUNT_VOLUME)
OWNED_MOUNT_DIRS = (contract.CONFIG_DIR, contract.KEYS_DIR, contract.CHECKPOINT_DIR, contract.SERVICE_ACCOUNT_DIR)
OWNED_MOUNT_PATHS = (*OWNED_MOUNT_DIRS, contract.SCRATCH_DIR, "/data")


def check_templates(job: Mapping[str, Any], problems: Problems) -> None:
    """Every role's template: each owned field, label, env name, volume or mount path it sets."""
    for role, key in ROLE_KEYS.items():
        path = f"spec.{key}.template"
        template = ((job.get("spec") or {}).get(key) or {}).get("template")
        if isinstance(template, Mapping) and not problems.at(path):
            _check_metadata(template.get("metadata") or {}, f"{path}.metadata", problems)
            _check_pod(template.get("spec") or {}, role, f"{path}.spec", problems)


def owned_label(key: str) -> bool:
    return key in OWNED_LABELS or key.startswith(OWNED_PREFIX)


def owned_env(name: str) -> bool:
    return name in OWNED_ENV or name.startswith(OWNED_ENV_PREFIX)


def owned_mount(path: str) -> bool:
    return path in OWNED_MOUNT_PATHS or any(path.startswith(d + "/") for d in OWNED_MOUNT_DIRS)


def _refuse(problems: Problems, path: str, what: str, names: list[str], why: str) -> None:
    if names:
        problems.add(path, f"{what} {', '.join(show(n) for n in names)}: {why}")


def _check_metadata(metadata: Mapping[str, Any], path: str, problems: Problems) -> None:
    labels = [k for k in metadata.get("labels") or {} if owned_label(k)]
    _refuse(problems, f"{path}.labels", "label", labels,
            "the operator's labels (app.kubernetes.io/name, instance, component, managed-by and "
            f"{OWNED_PREFIX}*) select the job's pods and cannot be set")
    annotations = [k for k in metadata.get("annotations") or {} if k.startswith(OWNED_PREFIX)]
    _refuse(problems, f"{path}.annotations", "annotation", annotations,
            f"annotations under {OWNED_PREFIX} are the operator's and cannot be set")


def _check_pod(pod: Mapping[str, Any], role: str, path: str, problems: Problems) -> None:
    _refuse(problems, path, "field", [f for f in OWNED_POD_FIELDS if f in pod],
            "the operator's (the roles run hardened, non-root, without a service account token)")
    volumes = [v.get("name") for v in pod.get("volumes") or [] if v.get("name") in OWNED_VOLUMES]
    _refuse(problems, f"{path}.volumes", "volume name", volumes,
            f"the operator's ({', '.join(OWNED_VOLUMES)}); choose another name")
    for i, container in enumerate(pod.get("containers") or []):
        if container.get("name") not in (None, role):
            problems.add(f"{path}.containers", f"the one container is the role's own: name {role}, or leave the "
                         f"name unset (got {show(container.get('name'))})")
        where = f"{path}.containers[{i}]"
        _refuse(problems, where, "field", [f for f in OWNED_CONTAINER_FIELDS if f in container],
                "the operator's (set spec.image, spec.parameterServers.resources or spec.workers.resources instead)")
        env = [e.get("name") for e in container.get("env") or [] if owned_env(str(e.get("name")))]
        _refuse(problems, f"{where}.env", "env name", env, "set by the operator")
        mounts = [m.get("mountPath") for m in container.get("volumeMounts") or [] if owned_mount(str(m.get("mountPath")))]
        _refuse(problems, f"{where}.volumeMounts", "mount path", mounts,
                f"the operator's ({', '.join(OWNED_MOUNT_PATHS)})")
