"""Will the model fit? A warning, not an error, when the pods' memory limits look too
small for the model's parameters and optimizer state (the estimate cannot know numpy's
and ZeroMQ's overheads, so a limit just above it may still be too small)."""

from __future__ import annotations

import math

from distbelief.operator.render import podparts
from distbelief.operator.render.context import RenderContext
from distbelief.runtime import contract, jobspec

FLOAT_BYTES = 4
DIGITS_SHAPE = (64, 10)  # builtin:digits: features, classes


def parameter_count(spec: jobspec.JobSpec) -> int | None:
    """The model's parameters from the spec alone: a built-in model on a built-in or
    synthetic source; None when only loading the data or user code would tell."""
    model = spec.model
    if model.builtin is None:
        return None
    scheme, _, body = spec.data.source.partition(":")
    if scheme == "builtin":
        features, classes = DIGITS_SHAPE
    elif scheme == "synthetic":
        params, problems = contract.synthetic_params(body)
        if problems:
            return None
        features, classes = params["features"], params["classes"]
    else:
        return None
    widths = [features, *(model.hidden_layers if model.builtin == "mlp" else ()), classes]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def warnings(spec: jobspec.JobSpec) -> list[str]:
    """memory_warnings for a model whose size the spec tells; none for another."""
    parameters = parameter_count(spec)
    return memory_warnings(spec, parameters) if parameters else []


def shard_bytes(spec: jobspec.JobSpec, parameters: int) -> int:
    """The bytes of one shard's arrays (its checkpoint holds no more)."""
    return math.ceil(parameters / spec.parameter_servers.shards) * _shard_arrays(spec.training) * FLOAT_BYTES


def memory_warnings(spec: jobspec.JobSpec, parameters: int) -> list[str]:
    """One line per pod kind whose memory limit is below what its arrays alone need."""
    shards = spec.parameter_servers.shards
    shard_arrays = _shard_arrays(spec.training)
    needs: dict[str, tuple[jobspec.ParameterServers | jobspec.Workers, int, str]] = {
        "parameterServers": (spec.parameter_servers, shard_bytes(spec, parameters),
                             f"each shard holds {shard_arrays} float32 arrays of its "
                             f"{math.ceil(parameters / shards):,} parameters"),
        "workers": (spec.workers, *_replica_pod_need(parameters, spec.model.partitions)),
    }
    lines = []
    for role, (section, need, why) in needs.items():
        limit = (section.resources.get("limits") or {}).get("memory")
        if limit is not None and podparts.cpu_cores(limit) < need:
            lines.append(f"spec.{role}.resources.limits.memory: {limit} is likely too small: {why} "
                         f"(about {_gib(need)}) before any overhead")
    return lines


def _replica_pod_need(parameters: int, partitions: int) -> tuple[int, str]:
    """Bytes a replica's pod needs at least, and why. A partitioned replica's pod holds its
    stage's parameters only: the heaviest stage has at least the average share."""
    if partitions == 1:
        return parameters * 3 * FLOAT_BYTES, \
            f"each replica holds 3 float32 arrays of the model's {parameters:,} parameters"
    share = math.ceil(parameters / partitions)
    return share * 3 * FLOAT_BYTES, (f"the pod of a replica's heaviest stage holds 3 float32 arrays of at least "
                                     f"{share:,} parameters (the model's {parameters:,} over {partitions} partitions)")


def _shard_arrays(training: jobspec.Training) -> int:
    """Arrays of a shard's slice size it holds. Downpour: the parameters, a gradient
    received, a checkpoint copy, and Adagrad's sums. Sandblaster: the parameters, the
    gradient, the search direction, the trial point and the L-BFGS history pairs."""
    if training.algorithm == "sandblaster":
        return 4 + 2 * training.sandblaster.history_size
    return 3 + (training.optimizer == "adagrad")


def _gib(size: int) -> str:
    return f"{size / 2 ** 30:.1f} GiB" if size >= 2 ** 30 else f"{size / 2 ** 20:.0f} MiB"


# How long a role may take to start serving: loading the data and building the model (a
# built-in or synthetic source whose size the spec tells: STARTUP_SECONDS; npz files, user
# code or embeddings, whose size only loading tells: STARTUP_UNKNOWN_SECONDS), and for a
# shard also reading its checkpoint, at RESTORE_BYTES_PER_SECOND (a slow network disk).
STARTUP_SECONDS = 300
STARTUP_UNKNOWN_SECONDS = 900
RESTORE_BYTES_PER_SECOND = 20 * 2 ** 20


def startup_seconds(ctx: RenderContext, role: str) -> int:
    """The startup probe's budget for a role's pods (see STARTUP_SECONDS)."""
    parameters = None if ctx.spec.model.embeddings else parameter_count(ctx.spec)
    if parameters is None:
        return STARTUP_UNKNOWN_SECONDS
    if role != contract.ROLE_PS:
        return STARTUP_SECONDS
    checkpoint = shard_bytes(ctx.spec, parameters)
    return STARTUP_SECONDS + -(-checkpoint // RESTORE_BYTES_PER_SECOND)
