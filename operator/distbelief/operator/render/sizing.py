"""Will the model fit? A warning, not an error, when the pods' memory limits look too
small for the model's parameters and optimizer state (the estimate cannot know numpy's
and ZeroMQ's overheads, so a limit just above it may still be too small)."""

from __future__ import annotations

import math
from typing import Any, Mapping

from distbelief.operator.render import podparts
from distbelief.runtime import contract

FLOAT_BYTES = 4
DIGITS_SHAPE = (64, 10)  # builtin:digits: features, classes


def parameter_count(spec: Mapping[str, Any]) -> int | None:
    """The model's parameters from the spec alone: a built-in model on a built-in or
    synthetic source; None when only loading the data or user code would tell."""
    model, source = spec["model"], spec["data"]["source"]
    if model.get("entrypoint"):
        return None
    scheme, _, body = source.partition(":")
    if scheme == "builtin":
        features, classes = DIGITS_SHAPE
    elif scheme == "synthetic":
        params, problems = contract.synthetic_params(body)
        if problems:
            return None
        features, classes = params["features"], params["classes"]
    else:
        return None
    widths = [features, *(model.get("hiddenLayers", []) if model.get("type", "mlp") == "mlp" else []), classes]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def shard_bytes(spec: Mapping[str, Any], parameters: int) -> int:
    """The bytes of one shard's arrays (its checkpoint holds no more)."""
    return math.ceil(parameters / int(spec["parameterServers"]["shards"])) * _shard_arrays(spec["training"]) * FLOAT_BYTES


def memory_warnings(spec: Mapping[str, Any], parameters: int) -> list[str]:
    """One line per pod kind whose memory limit is below what its arrays alone need."""
    shards = int(spec["parameterServers"]["shards"])
    shard_arrays = _shard_arrays(spec["training"])
    needs = {
        "parameterServers": (shard_bytes(spec, parameters),
                             f"each shard holds {shard_arrays} float32 arrays of its "
                             f"{math.ceil(parameters / shards):,} parameters"),
        "workers": _replica_pod_need(parameters, int(spec["model"].get("partitions", 1))),
    }
    lines = []
    for role, (need, why) in needs.items():
        limit = ((spec[role].get("resources") or {}).get("limits") or {}).get("memory")
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


def _shard_arrays(training: Mapping[str, Any]) -> int:
    """Arrays of a shard's slice size it holds. Downpour: the parameters, a gradient
    received, a checkpoint copy, and Adagrad's sums. Sandblaster: the parameters, the
    gradient, the search direction, the trial point and the L-BFGS history pairs."""
    if training.get("algorithm") == "sandblaster":
        return 4 + 2 * int(training["sandblaster"]["historySize"])
    return 3 + bool(training.get("adagrad", True))


def _gib(size: int) -> str:
    return f"{size / 2 ** 30:.1f} GiB" if size >= 2 ** 30 else f"{size / 2 ** 20:.0f} MiB"
