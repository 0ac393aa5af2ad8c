"""The job as the runtime uses it: a DistBeliefJob's spec, resolved once into frozen values.

    JobSpec
    ├── model: Model                 type, hiddenLayers, activation, l2, entrypoint, partitions, microBatches
    │   └── embeddings: Embeddings   dim, hashBuckets, admitAfter, expireAfterSeconds, wide,
    │                                l2, wideL2, embedAfter, maxRowsPerShard (or None)
    ├── data: Data                   source, testFraction, seed, maxEvalExamples, volume,
    │                                test, label, features, ids, onBadFile
    ├── training: Training           algorithm, optimizer, rates, fetch/push, stopping rules,
    │   │                            keepBest, failOnDegraded
    │   └── sandblaster: Sandblaster historySize, workUnitSize, backupTasks, gradientTolerance
    └── parameter_servers: ParameterServers   shards, backups, port, encryption, wireFormat,
        │                                     the memory limit (resources.limits.memory)
        └── checkpoint: Checkpointing        everySeconds, keep

`resolve(spec)` is the one place that reads the CRD's camelCase keys; every runtime module
takes these values instead (tests/unit/test_jobspec.py checks that no other runtime module
names a key). The spec it reads is the one `distbelief.operator.spec.validate_job` has
already checked and filled with the CRD's defaults, the one the ConfigMap holds; the field
defaults here are the CRD's (a test compares them), so that a config written before a
field existed still resolves, and a test or a tool can build a value in a line.
What the operator alone renders (resources, storage, autoscaling, run policy) is not here,
but for the shards' memory limit, from which a shard derives its row budget.

Like contract.py, this module imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import types
from decimal import Decimal
from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Embeddings:
    """spec.model.embeddings: rows over the data's categorical id fields, kept on the shards."""

    dim: int = 16
    hash_buckets: int = 0                       # 0: collisionless
    admit_after: int = 1                        # occurrences before an id gets a row
    expire_after_seconds: float | None = None   # None: rows never expire
    # The wide part, the rows' lazy L2 and embedAfter: defaults measured on click data shaped
    # like real logs (docs/benchmarks.md, "Click data shaped like real logs").
    wide: bool = True                           # each id's linear weight per class beside its embedding
    l2: float = 1e-3                            # L2 weight on the rows' embedding values
    wide_l2: float = 3e-5                       # ... on their wide values
    embed_after: int = 5                        # occurrences before an id's embedding is used
    max_rows_per_shard: int | None = None       # None: derived from the shards' memory limit


@dataclasses.dataclass(frozen=True)
class Model:
    """spec.model. `written` is spec.model as the job gives it, for user code
    (entrypoint), which is called with it and may read keys of its own."""

    type: str = "mlp"                           # mlp | softmax
    hidden_layers: tuple[int, ...] = (64,)
    activation: str = "relu"
    l2: float = 0.0
    entrypoint: str | None = None               # "module:function"
    partitions: int = 1                         # stages of one replica (model parallelism)
    micro_batches: int = 1                      # parts of a minibatch that go through the stages one after another
    embeddings: Embeddings | None = None
    written: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class ObjectStore:
    """spec.data.objectStore: where an s3:// source's bucket is (its credentials are the
    Secret's, in the pods' environment: never here)."""

    endpoint: str | None = None                 # a URL; None: AWS
    region: str | None = None
    secret_ref: str | None = None               # the Secret the operator renders as env


@dataclasses.dataclass(frozen=True)
class Data:
    """spec.data."""

    source: str
    test_fraction: float = 0.2
    seed: int = 0
    max_eval_examples: int = 10000
    volume: str | None = None                   # a PersistentVolumeClaim mounted at /data
    test: str | None = None                     # a file source's held-out files (a glob)
    label: str = "y"                            # a file source's label column
    features: tuple[str, ...] | None = None     # its feature columns; None: every other numeric one
    ids: tuple[str, ...] = ()                   # its id columns, for embeddings
    on_bad_file: str = "fail"                   # fail | skip
    object_store: ObjectStore | None = None     # an s3:// source's store

    @property
    def is_file_set(self) -> bool:
        """Many files read by column: parquet:, csv:, npy:, npz: with a glob, or s3:// (model/files.py)."""
        scheme, _, path = self.source.partition(":")
        return (scheme in ("parquet", "csv", "npy", "s3") or
                (scheme == "npz" and any(c in path for c in "*?[")))


@dataclasses.dataclass(frozen=True)
class Sandblaster:
    """spec.training.sandblaster: the L-BFGS coordinator's settings."""

    history_size: int = 10
    work_unit_size: int = 64
    backup_tasks: bool = True
    gradient_tolerance: float = 1e-5


@dataclasses.dataclass(frozen=True)
class Training:
    """spec.training."""

    algorithm: str = "downpour"                 # downpour | sandblaster
    optimizer: str = "adagrad"
    batch_size: int = 32
    learning_rate: float = 0.1
    max_gradient_norm: float = 100.0
    max_staleness: int | None = None            # None: unbounded
    fetch_every: int = 1
    push_every: int = 1
    overlap: bool = False                       # compute the next step while the last one's exchange is out
    warmstart_steps: int = 0
    max_steps: int = 10000
    target_accuracy: float | None = None
    target_loss: float | None = None
    max_duration_seconds: float | None = None   # spec.training.maxDuration, in seconds
    eval_every_seconds: float = 2.0
    seed: int = 0
    keep_best: bool = False                     # save params-best.npz at each new best evaluation
    fail_on_degraded: bool = False              # a degraded model fails the job
    sandblaster: Sandblaster = Sandblaster()


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """spec.parameterServers.checkpoint (its storage is the operator's)."""

    every_seconds: float = 30.0
    keep: int = 3


@dataclasses.dataclass(frozen=True)
class ParameterServers:
    """spec.parameterServers."""

    shards: int = 1
    backups: int = 0                            # chain-replicated copies of each shard
    port: int = 7070
    encryption: bool = True
    wire_format: str = "float32"                # float32 | bfloat16
    checkpoint: Checkpointing = Checkpointing()
    memory_limit: str | None = None             # resources.limits.memory, a quantity ("2Gi"); None: none

    @property
    def copies(self) -> int:
        """Copies of each shard: the primary and its backups."""
        return 1 + self.backups


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What the runtime uses of a job's spec, every default applied."""

    data: Data
    model: Model = Model()
    training: Training = Training()
    parameter_servers: ParameterServers = ParameterServers()

    @property
    def streams_data(self) -> bool:
        """The replicas stream the units the chief hands them (algorithms/feed/), rather than
        each loading the data set: a file source under Downpour, with or without embeddings
        (a partitioned replica's partition 0 streams; Sandblaster loads it whole)."""
        return self.data.is_file_set and self.training.algorithm == "downpour"


def resolve(spec: Mapping[str, Any]) -> JobSpec:
    """The typed job of a resolved spec (the ConfigMap's). ValueError names the field
    that is missing or of the wrong type."""
    top = _Section(spec, "spec")
    model, data, training, servers = (top.section(key) for key in ("model", "data", "training", "parameterServers"))
    sandblaster, checkpoint = training.section("sandblaster"), servers.section("checkpoint")
    embeddings = model.section("embeddings") if model.values.get("embeddings") is not None else None
    store = data.section("objectStore") if data.values.get("objectStore") is not None else None
    return JobSpec(
        model=Model(
            type=model.get("type", str, Model.type),
            hidden_layers=tuple(model.get("hiddenLayers", _ints, Model.hidden_layers)),
            activation=model.get("activation", str, Model.activation),
            l2=model.get("l2", float, Model.l2),
            entrypoint=model.get("entrypoint", str, None) or None,
            partitions=model.get("partitions", int, Model.partitions),
            micro_batches=model.get("microBatches", int, Model.micro_batches),
            embeddings=None if embeddings is None else Embeddings(
                dim=embeddings.get("dim", int, Embeddings.dim),
                hash_buckets=embeddings.get("hashBuckets", int, Embeddings.hash_buckets),
                admit_after=embeddings.get("admitAfter", int, Embeddings.admit_after),
                expire_after_seconds=embeddings.get("expireAfterSeconds", float, None) or None,
                wide=embeddings.get("wide", bool, Embeddings.wide),
                l2=embeddings.get("l2", float, Embeddings.l2),
                wide_l2=embeddings.get("wideL2", float, Embeddings.wide_l2),
                embed_after=embeddings.get("embedAfter", int, Embeddings.embed_after),
                max_rows_per_shard=embeddings.get("maxRowsPerShard", int, None)),
            written=types.MappingProxyType(dict(model.values))),
        data=Data(
            source=data.get("source", str),
            test_fraction=data.get("testFraction", float, Data.test_fraction),
            seed=data.get("seed", int, Data.seed),
            max_eval_examples=data.get("maxEvalExamples", int, Data.max_eval_examples),
            volume=data.get("volume", str, None) or None,
            test=data.get("test", str, None) or None,
            label=data.get("label", str, Data.label),
            features=_optional_names(data.get("features", _names, None)),
            ids=tuple(data.get("ids", _names, [])),
            on_bad_file=data.get("onBadFile", str, Data.on_bad_file),
            object_store=None if store is None else ObjectStore(
                endpoint=store.get("endpoint", str, None), region=store.get("region", str, None),
                secret_ref=store.get("secretRef", str, None))),
        training=Training(
            algorithm=training.get("algorithm", str, Training.algorithm),
            optimizer=training.get("optimizer", str, Training.optimizer),
            batch_size=training.get("batchSize", int, Training.batch_size),
            learning_rate=training.get("learningRate", float, Training.learning_rate),
            max_gradient_norm=training.get("maxGradientNorm", float, Training.max_gradient_norm),
            max_staleness=training.get("maxStaleness", int, None),
            fetch_every=training.get("fetchEvery", int, Training.fetch_every),
            push_every=training.get("pushEvery", int, Training.push_every),
            overlap=training.get("overlap", bool, Training.overlap),
            warmstart_steps=training.get("warmstartSteps", int, Training.warmstart_steps),
            max_steps=training.get("maxSteps", int, Training.max_steps),
            target_accuracy=training.get("targetAccuracy", float, None),
            target_loss=training.get("targetLoss", float, None),
            max_duration_seconds=training.get("maxDuration", parse_duration, None),
            eval_every_seconds=training.get("evalEverySeconds", float, Training.eval_every_seconds),
            seed=training.get("seed", int, Training.seed),
            keep_best=training.get("keepBest", bool, Training.keep_best),
            fail_on_degraded=training.get("failOnDegraded", bool, Training.fail_on_degraded),
            sandblaster=Sandblaster(
                history_size=sandblaster.get("historySize", int, Sandblaster.history_size),
                work_unit_size=sandblaster.get("workUnitSize", int, Sandblaster.work_unit_size),
                backup_tasks=sandblaster.get("backupTasks", bool, Sandblaster.backup_tasks),
                gradient_tolerance=sandblaster.get("gradientTolerance", float, Sandblaster.gradient_tolerance))),
        parameter_servers=ParameterServers(
            shards=servers.get("shards", int, ParameterServers.shards),
            backups=servers.get("backups", int, ParameterServers.backups),
            port=servers.get("port", int, ParameterServers.port),
            encryption=servers.get("encryption", bool, ParameterServers.encryption),
            wire_format=servers.get("wireFormat", str, ParameterServers.wire_format),
            checkpoint=Checkpointing(
                every_seconds=checkpoint.get("everySeconds", float, Checkpointing.every_seconds),
                keep=checkpoint.get("keep", int, Checkpointing.keep)),
            memory_limit=servers.section("resources").section("limits").get("memory", _quantity, None)),
    )


_REQUIRED: Any = object()


@dataclasses.dataclass(frozen=True)
class _Section:
    """One mapping of the spec and its path, read key by key: a missing key takes its
    default (a config from before the field existed); a missing required key, or a value
    of the wrong type, is a ValueError naming the field."""

    values: Mapping[str, Any]
    path: str

    def section(self, key: str) -> "_Section":
        value = self.values.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"{self.path}.{key}: must be a mapping (got {value!r})")
        return _Section(value or {}, f"{self.path}.{key}")

    def get(self, key: str, convert: Callable[[Any], T], default: Any = _REQUIRED) -> T:
        value, field = self.values.get(key), f"{self.path}.{key}"
        if value is None:
            if default is _REQUIRED:
                raise ValueError(f"{field}: required")
            return default
        if convert in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{field}: must be a number (got {value!r})")
        if convert is int and value != int(value):
            raise ValueError(f"{field}: must be an integer (got {value!r})")
        if convert in (bool, str) and not isinstance(value, convert):
            raise ValueError(f"{field}: must be a {'boolean' if convert is bool else 'string'} (got {value!r})")
        try:
            return convert(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{field}: {exc}") from None


_QUANTITY_SUFFIXES = {"m": Decimal("0.001"), **{p: Decimal(10) ** (3 * i) for i, p in enumerate("kMGTPE", 1)},
                      **{p + "i": Decimal(2) ** (10 * i) for i, p in enumerate("KMGTPE", 1)}}


def quantity(text: str | int | float) -> Decimal:
    """A Kubernetes quantity ("500m", "2", "1.5" CPUs; "1Gi", "512M", "1e9" bytes) as a number."""
    text = str(text)
    for suffix in sorted(_QUANTITY_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix):
            return Decimal(text[: -len(suffix)]) * _QUANTITY_SUFFIXES[suffix]
    return Decimal(text)


def _quantity(value: Any) -> str:
    """A Kubernetes quantity as text: the CRD takes "2Gi" or a number of bytes."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"must be a quantity such as 2Gi (got {value!r})")
    return str(value)


def _ints(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"must be a list of integers (got {value!r})")
    return value


def _names(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"must be a list of column names (got {value!r})")
    return value


def _optional_names(value: list[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


def parse_duration(text: str) -> float:
    """Seconds in a Go-style duration such as '90s', '1h30m' or '250ms'."""
    if not isinstance(text, str):
        raise ValueError(f"not a duration: {text!r}")
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    total, number = 0.0, ""
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isdigit() or ch == ".":
            number += ch
            i += 1
            continue
        unit = "ms" if text.startswith("ms", i) else ch
        if unit not in units or not number:
            raise ValueError(f"not a duration: {text!r}")
        total += float(number) * units[unit]
        number = ""
        i += len(unit)
    if number:
        raise ValueError(f"not a duration (missing unit): {text!r}")
    if not text:
        raise ValueError("not a duration: empty")
    return total
