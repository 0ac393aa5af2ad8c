"""The operator <-> runtime contract: names, labels, ports, paths and the resolved config.

Everything both sides must agree on without talking lives here, and nothing else. This
module imports only the standard library, so the operator can use it without pulling in
the runtime, and the runtime roles can use it without kopf or the kubernetes client.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from distbelief.runtime import jobresolve, jobspec

API_GROUP = "distbelief.io"
API_VERSION = "v1alpha1"
JOB_API_VERSION = f"{API_GROUP}/{API_VERSION}"   # a DistBeliefJob's apiVersion
KIND = "DistBeliefJob"
PLURAL = "distbeliefjobs"

# The outcomes the chief decides, which are also the job's final phases.
SUCCEEDED, FAILED = "Succeeded", "Failed"
MODEL_DEGRADED = "ModelDegraded"  # a condition, and the reason of a job failed by failOnDegraded
UPDATES_LOST = "UpdatesLost"      # a condition, and the reason of a job failed by failOnUpdatesLost
# Data sets the runtime ships (spec.data.source "builtin:<name>").
BUILTIN_DATASETS: tuple[str, ...] = ("digits",)


class Metric:
    """Names of the metrics the roles export and the operator and local mode read.
    (Counters are exported with a _total suffix, histograms with _bucket, _sum, _count.)"""

    GLOBAL_STEP = "distbelief_global_step"
    TRAIN_LOSS = "distbelief_train_loss"
    EXAMPLES_PER_SECOND = "distbelief_examples_per_second"
    CHECKPOINT_STEP = "distbelief_checkpoint_step"
    CHECKPOINT_TIME = "distbelief_checkpoint_timestamp_seconds"
    STALENESS = "distbelief_staleness_updates"
    STALENESS_MAX = "distbelief_staleness_max"
    HELDOUT_LOSS = "distbelief_heldout_loss"
    HELDOUT_ACCURACY = "distbelief_heldout_accuracy"
    HELDOUT_AUC = "distbelief_heldout_auc"
    DATA_EPOCH = "distbelief_data_epoch"
    JOB_FINISHED = "distbelief_job_finished"
    SANDBLASTER_OBJECTIVE = "distbelief_sandblaster_objective"
    SANDBLASTER_EVALUATIONS = "distbelief_sandblaster_evaluations"
    WORKER_LOSS = "distbelief_worker_loss"
    WORKER_STEPS = "distbelief_worker_steps"
    WORKER_EXAMPLES = "distbelief_worker_examples"
    TRANSPORT_BYTES_IN = "distbelief_transport_bytes_in"    # every socket of the pod's process
    TRANSPORT_BYTES_OUT = "distbelief_transport_bytes_out"
    WORKER_PUSHES_ACKNOWLEDGED = "distbelief_worker_pushes_acknowledged"
    SHARD_COPIES = "distbelief_shard_copies"
    SHARD_PRIMARY = "distbelief_shard_primary_copy"
    SHARD_FAILOVERS = "distbelief_shard_failovers"
    UPDATES_LOST = "distbelief_updates_lost"       # the chief's, by shard: applied updates a shard lost
    MODEL_DEGRADED = "distbelief_model_degraded"   # the chief's: 1 with the reason and message, once judged
    ROWS = "distbelief_rows"                       # a shard's embedding rows
    ROW_BUDGET = "distbelief_row_budget"           # its budget (spec.model.embeddings.maxRowsPerShard; 0: none)
    ROWS_REFUSED = "distbelief_rows_refused"       # rows it did not create for want of room
    ROWS_EVICTED = "distbelief_rows_evicted"       # rows it evicted to make room
    JOB_ROWS = "distbelief_job_rows"  # the chief's, by figure: max (the fullest shard's), budget, refused, evicted

# An s3:// source's credentials: the keys of the Secret spec.data.objectStore.secretRef, env of every pod.
OBJECT_STORE_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")

# Ports inside every pod. The shard port comes from the spec; these are fixed.
METRICS_PORT = 9100
METRICS_PORT_NAME = "metrics"
SHARD_PORT_NAME = "ps"
# Sandblaster's coordinator runs beside shard 0 and takes replicas' requests on this port.
COORDINATOR_PORT = 7171
COORDINATOR_PORT_NAME = "coordinator"
# A partitioned replica's stages (spec.model.partitions > 1): each worker pod serves the
# activations of its stage's upstream neighbour on this port, and finds its group's other
# pods through the rendezvous beside shard 0 (on the coordinator port, which Downpour
# leaves free).
STAGE_PORT = 7172
STAGE_PORT_NAME = "stage"
# An encrypted job's shards take the AES-GCM-sealed messages of the sessions their peers
# agreed over CurveZMQ on this port (docs/security.md); the shard port tells peers of it.
BULK_PORT = 7173
BULK_PORT_NAME = "bulk"
HEALTH_PATH = "/healthz"   # liveness: the process runs
READY_PATH = "/readyz"     # readiness: the role serves (a shard restored, a replica joined)

# Paths inside the pods, and the ConfigMap key the resolved config is stored under.
CONFIG_KEY = "job.json"
CONFIG_DIR = "/etc/distbelief"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
CHECKPOINT_DIR = "/var/lib/distbelief/checkpoints"
CHECKPOINT_VOLUME = "checkpoints"
# The job's CurveZMQ keys (the Secret <job>-keys; distbelief.runtime.keys names the
# files). Not under CONFIG_DIR: a mount point inside a read-only ConfigMap volume cannot
# be created by the container runtime.
KEYS_DIR = "/etc/distbelief-keys"
KEYS_VOLUME = "keys"
SCRATCH_DIR = "/tmp"

# Environment the roles read. POD_NAME comes from the downward API; the shard
# addresses are derived from the headless Service unless PS_ADDRESSES overrides them
# (local mode runs every shard on loopback).
ENV_POD_NAME = "POD_NAME"
ENV_PS_ADDRESSES = "DISTBELIEF_PS_ADDRESSES"
ENV_COORDINATOR_ADDRESS = "DISTBELIEF_COORDINATOR_ADDRESS"
# A partitioned job's worker pods: which partition (0..N-1) the pod computes, and the
# address its stage serves on, as its group's other pods reach it (on a cluster
# tcp://$(POD_IP):STAGE_PORT, POD_IP from the downward API).
ENV_PARTITION = "DISTBELIEF_PARTITION"
ENV_POD_IP = "POD_IP"
ENV_STAGE_ADDRESS = "DISTBELIEF_STAGE_ADDRESS"
# With backups: where a shard's copies keep their view ("file:FOLDER" in local mode,
# "kubernetes" for a Lease per shard; unset on a cluster means kubernetes), and how this
# copy reaches its shard's other copies, by rank (default: their shard addresses).
ENV_VIEW_STORE = "DISTBELIEF_VIEW_STORE"
ENV_COPY_ROUTES = "DISTBELIEF_COPY_ROUTES"
ENV_COPY_LEASE = "DISTBELIEF_COPY_LEASE_SECONDS"  # the primary's lease (default 3): shorter fails over sooner
# The Lease store's credentials: the folder of the pod's ServiceAccount token, CA and
# namespace (the operator mounts the shard copies' token there and names it).
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICE_ACCOUNT_VOLUME = "view-lease-token"
ENV_SERVICE_ACCOUNT_DIR = "DISTBELIEF_SERVICE_ACCOUNT_DIR"
# A folder of this machine only the job's user may use (0700), for the bulk ports' Unix
# sockets: local mode makes one per run; unset on a cluster, where every role has its pod.
ENV_SOCKET_DIR = "DISTBELIEF_SOCKET_DIR"

# Files the chief (shard 0) writes beside its checkpoints.
HISTORY_FILE = "history.jsonl"   # one JSON line per held-out evaluation
RESULT_FILE = "result.json"      # the job's outcome, once decided
PARAMS_FILE = "params.npz"       # the final parameters, one array per named tensor
BEST_PARAMS_FILE = "params-best.npz"  # spec.training.keepBest: those of the best evaluation

# Environment every role runs with: glibc's allocator keeps freed memory for reuse.
# A frame over 32 MiB (a large model's slice, received by ZeroMQ or sealed/opened by
# AES-GCM into a fresh buffer) would otherwise get fresh pages from the kernel on every
# message, zeroed and faulted in one by one: 41 % of a 90M-parameter job's shard CPU.
# mmap_max=0 serves every block from the heap and the trim threshold keeps the heap
# from shrinking, so each message reuses pages already in place (that job: 48 -> 68
# examples/s); the cost is that a role's RSS stays at its peak (docs/benchmarks.md).
# Huge pages for what is newly mapped.
ROLE_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:"
                              "glibc.malloc.trim_threshold=4294967296"}

ROLE_PS = "ps"
ROLE_WORKER = "worker"

# Labels of the operator's pods (the Helm chart sets them): a job's NetworkPolicy admits
# the operator to the shards' metrics port by them.
OPERATOR_LABELS = {"app.kubernetes.io/name": "distbelief", "app.kubernetes.io/component": "operator"}

LABEL_JOB = f"{API_GROUP}/job"
LABEL_ROLE = f"{API_GROUP}/role"

# Kubernetes limits the names derived from a job's name must respect. A StatefulSet's
# name plus "-" and a 10-character revision hash must fit a 63-character label value.
DNS_LABEL_MAX = 63
STATEFULSET_NAME_MAX = DNS_LABEL_MAX - 11
PS_SUFFIX = "-ps"
WORKER_SUFFIX = "-worker"
CONFIG_SUFFIX = "-config"
KEYS_SUFFIX = "-keys"
MAX_JOB_NAME = STATEFULSET_NAME_MAX - len(PS_SUFFIX)


@dataclasses.dataclass(frozen=True)
class JobNames:
    """Names of every child of one job, in one place."""

    job: str

    @property
    def config_map(self) -> str:
        return self.job + CONFIG_SUFFIX

    @property
    def keys_secret(self) -> str:
        """The Secret with the job's CurveZMQ keys, made once by the operator."""
        return self.job + KEYS_SUFFIX

    @property
    def ps(self) -> str:
        """The headless Service and the StatefulSet of the shards."""
        return self.job + PS_SUFFIX

    @property
    def worker(self) -> str:
        """The Deployment (and the HPA) of the model replicas."""
        return self.job + WORKER_SUFFIX

    def worker_partition(self, partition: int) -> str:
        """The Deployment of one partition's pods in a job with spec.model.partitions > 1."""
        return f"{self.worker}-p{partition}"

    def shard_pod(self, ordinal: int) -> str:
        """The StatefulSet's pod `ordinal`: shard ordinal % shards, copy ordinal // shards."""
        return f"{self.ps}-{ordinal}"

    def shard_address(self, index: int, namespace: str, port: int) -> str:
        return f"tcp://{self.shard_pod(index)}.{self.ps}.{namespace}.svc:{port}"

    @property
    def ps_access(self) -> str:
        """With backups: the shard pods' ServiceAccount, and the Role and RoleBinding that let
        it keep the shards' view Leases."""
        return self.ps

    def shard_lease(self, index: int) -> str:
        """With backups: the coordination.k8s.io Lease that holds shard index's view."""
        return f"{self.job}-shard-{index}"


def selector_labels(job: str, role: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_ROLE: role}


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """The resolved job the roles read: the spec with every default applied, and on a
    cluster the job's uid (which the shards write into their checkpoints, so that a job of
    the same name never resumes another's training; local mode has none).

    `written` is the spec as the ConfigMap holds it, a dict: what to_json writes (the
    operator's config hash is taken of it); `spec` is the same job typed (jobspec.JobSpec),
    resolved once when the config is made: what every reader of a value reads."""

    name: str
    namespace: str
    written: Mapping[str, Any]
    uid: str | None = None
    spec: jobspec.JobSpec = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", jobresolve.resolve(self.written))

    @property
    def names(self) -> JobNames:
        return JobNames(self.name)

    def copy_of(self, ordinal: int) -> tuple[int, int]:
        """(shard, copy rank) of the shards' StatefulSet pod `ordinal`."""
        shards = self.spec.parameter_servers.shards
        return ordinal % shards, ordinal // shards

    def shard_addresses(self, environ: Mapping[str, str] = os.environ) -> list[str]:
        """Where the shards listen (their first copies): PS_ADDRESSES if set, else the
        headless Service's DNS."""
        return self._pod_addresses(environ)[:self.spec.parameter_servers.shards]

    def copy_addresses(self, environ: Mapping[str, str] = os.environ) -> list[list[str]]:
        """Every copy's address, by shard, then by copy rank."""
        every, shards = self._pod_addresses(environ), self.spec.parameter_servers.shards
        return [every[shard::shards] for shard in range(shards)]

    def _pod_addresses(self, environ: Mapping[str, str]) -> list[str]:
        servers = self.spec.parameter_servers
        pods = servers.shards * servers.copies
        override = environ.get(ENV_PS_ADDRESSES, "").strip()
        if override:
            addresses = [a.strip() for a in override.split(",") if a.strip()]
            if len(addresses) != pods:
                copies = f" of {servers.copies} copies each" if servers.copies > 1 else ""
                raise ValueError(f"{ENV_PS_ADDRESSES} lists {len(addresses)} addresses, "
                                 f"but the job has {servers.shards} shards{copies}")
            return addresses
        return [self.names.shard_address(i, self.namespace, servers.port) for i in range(pods)]

    def coordinator_address(self, environ: Mapping[str, str] = os.environ) -> str:
        """Where Sandblaster's coordinator, or a partitioned job's rendezvous, listens: beside
        shard 0 (or the override)."""
        override = environ.get(ENV_COORDINATOR_ADDRESS, "").strip()
        return override or self.names.shard_address(0, self.namespace, COORDINATOR_PORT)

    def to_json(self) -> str:
        return json.dumps(
            {"apiVersion": JOB_API_VERSION, "kind": "JobConfig",
             "name": self.name, "namespace": self.namespace, "spec": self.written,
             **({"uid": self.uid} if self.uid else {})},
            indent=2, sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> "JobConfig":
        doc = json.loads(text)
        return cls(name=doc["name"], namespace=doc["namespace"], written=doc["spec"], uid=doc.get("uid"))

    @classmethod
    def load(cls, path: str) -> "JobConfig":
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())


def shard_index_from_pod_name(pod_name: str) -> int:
    """A StatefulSet pod's ordinal: the number after its last dash."""
    _, _, ordinal = pod_name.rpartition("-")
    if not ordinal.isdigit():
        raise ValueError(f"cannot read a shard index from pod name {pod_name!r}")
    return int(ordinal)


SYNTHETIC_REQUIRED = ("features", "classes", "samples")
SYNTHETIC_BOUNDS: dict[str, tuple[float, float]] = {
    "features": (1, 100_000),
    "classes": (2, 100_000),
    "samples": (10, 10_000_000),
    "seed": (0, 2**32 - 1),
}
# synthetic-ctr:fields=F,ids=N,samples=S[,zipf=A][,seed=K][,missing=P]: click-style ids per
# field; ids are ranks 0..N-1 (< 2**56, see embedding keys), a share `missing` of them -1.
CTR_REQUIRED = ("fields", "ids", "samples")
CTR_BOUNDS: dict[str, tuple[float, float]] = {
    "fields": (1, 64),
    "ids": (2, 2**40),
    "samples": (10, 10_000_000),
    "zipf": (0.5, 3.0),
    "seed": (0, 2**32 - 1),
    "missing": (0.0, 0.9),
}
CTR_DEFAULTS = {"zipf": 1.1, "seed": 0, "missing": 0.0}
REAL_PARAMETERS = ("zipf", "missing")


def synthetic_params(body: str) -> tuple[dict[str, int], list[str]]:
    """The parameters of a 'synthetic:' source body (features=F,classes=C,samples=N[,seed=S])
    and every problem found in it; seed defaults to 0."""
    params, problems = source_params(body, "synthetic", SYNTHETIC_BOUNDS, SYNTHETIC_REQUIRED)
    return {k: int(v) for k, v in {"seed": 0, **params}.items()}, problems


def ctr_params(body: str) -> tuple[dict[str, float], list[str]]:
    """The parameters of a 'synthetic-ctr:' source body and every problem found in it."""
    params, problems = source_params(body, "synthetic-ctr", CTR_BOUNDS, CTR_REQUIRED)
    return {**CTR_DEFAULTS, **params}, problems


def source_params(body: str, kind: str, bounds: Mapping[str, tuple[float, float]],
                  required: tuple[str, ...]) -> tuple[dict[str, float], list[str]]:
    """key=value pairs of a generator source, each checked against its bounds."""
    params: dict[str, float] = {}
    problems: list[str] = []
    seen: set[str] = set()
    for item in body.split(","):
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep or not key:
            problems.append(f"{kind}: expected key=value, got {item!r}")
        elif key not in bounds:
            problems.append(f"{kind}: unknown parameter {key!r} (known: {', '.join(bounds)})")
        elif key in seen:
            problems.append(f"{kind}: {key} given twice")
        else:
            value = _number(text, real=key in REAL_PARAMETERS)
            if value is None:
                kind_of = "a number" if key in REAL_PARAMETERS else "an integer"
                problems.append(f"{kind}: {key} must be {kind_of} (got {text!r})")
            else:
                params[key] = value
                low, high = bounds[key]
                if not low <= value <= high:
                    problems.append(f"{kind}: {key} must be within {_shown(low)}..{_shown(high)} (got {_shown(value)})")
        seen.add(key)
    problems.extend(f"{kind}: {key} required" for key in required if key not in seen)
    return params, problems


# The exit code of a role that stopped on a config error (ConfigError, a layout mismatch,
# an unusable checkpoint): restarting cannot help, so local mode and the operator end the
# job at once (reason InvalidConfig) instead of retrying it as a crash.
EXIT_INVALID_CONFIG = 2
# The exit code of a replica whose training loss stayed non-finite (the model diverged):
# restarting it would diverge again, so the job fails at once (reason NonFiniteLoss).
EXIT_NON_FINITE_LOSS = 3


def _number(text: str, *, real: bool) -> float | None:
    if not real:
        return int(text) if text.lstrip("+-").isdigit() else None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value == value else None  # NaN is no parameter


def _shown(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
