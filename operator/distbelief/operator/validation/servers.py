"""The rules of spec.parameterServers that an OpenAPI schema cannot say: what shard copies
and the journal cover, how many copies must hold an update, and where a bfloat16 wire is
carried."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distbelief.operator.validation.schemawalk import Problems, at_path


def check_servers(job: Mapping[str, Any], problems: Problems) -> None:
    _check_min_in_sync(job, problems)
    _check_backups(job, problems)
    _check_journal(job, problems)
    _check_wire_format(job, problems)


def _check_min_in_sync(job: Mapping[str, Any], problems: Problems) -> None:
    backups = at_path(job, "spec", "parameterServers", "backups")
    needed = at_path(job, "spec", "parameterServers", "minInSync")
    if isinstance(backups, int) and isinstance(needed, int) and needed > backups + 1:
        problems.add("spec.parameterServers.minInSync", "must be at most spec.parameterServers.backups + 1 (the "
                     f"copies of each shard); got {needed} with backups {backups}")


def _check_backups(job: Mapping[str, Any], problems: Problems) -> None:
    """What shard copies cannot cover yet: copies replay the same commands, so every state
    change must be one (Sandblaster's rollbacks read each copy's own checkpoints, and row
    expiry reads each copy's clock)."""
    path = "spec.parameterServers.backups"
    backups = at_path(job, "spec", "parameterServers", "backups")
    if not isinstance(backups, int) or backups == 0 or problems.at(path):
        return
    if at_path(job, "spec", "training", "algorithm") == "sandblaster":
        problems.add(path, "not available with spec.training.algorithm: sandblaster (its rollbacks restore each "
                     "copy's own checkpoints); use 0, or downpour")
    if at_path(job, "spec", "model", "embeddings", "expireAfterSeconds"):
        problems.add(path, "not available with spec.model.embeddings.expireAfterSeconds (each copy would expire "
                     "rows by its own clock); use 0, or leave rows unexpired")
    if at_path(job, "spec", "parameterServers", "template", "spec", "serviceAccountName"):
        problems.add(path, "not available with spec.parameterServers.template.spec.serviceAccountName (the shard "
                     "copies run as their own account, <job>-ps, which keeps their view Leases); use 0, or drop it")


def _check_journal(job: Mapping[str, Any], problems: Problems) -> None:
    """The journal replays one shard's commands on its own state: copies (which hold each
    acknowledged update already) and Sandblaster's rollbacks (which undo commands) are not
    what it replays."""
    path = "spec.parameterServers.journal"
    if at_path(job, "spec", "parameterServers", "journal") is not True or problems.at(path):
        return
    if (at_path(job, "spec", "parameterServers", "backups") or 0) > 0:
        problems.add(path, "not available with spec.parameterServers.backups > 0 (the copies hold each acknowledged "
                     "update instead); use false, or backups 0")
    if at_path(job, "spec", "training", "algorithm") == "sandblaster":
        problems.add(path, "not available with spec.training.algorithm: sandblaster (its rollbacks undo applied "
                     "commands); use false, or downpour")


def _check_wire_format(job: Mapping[str, Any], problems: Problems) -> None:
    """bfloat16 is carried by the dense Downpour ops alone (shard copies replay them as they
    are): what else moves arrays (Sandblaster's vectors, embedding rows, stages' activations
    and held gradients) stays float32, so refuse it there rather than have part of a job in
    one format and part in the other."""
    path = "spec.parameterServers.wireFormat"
    if at_path(job, "spec", "parameterServers", "wireFormat") != "bfloat16" or problems.at(path):
        return
    if at_path(job, "spec", "training", "algorithm") == "sandblaster":
        problems.add(path, "bfloat16 is not available with spec.training.algorithm: sandblaster; use float32, "
                     "or downpour")
    if at_path(job, "spec", "model", "embeddings") is not None:
        problems.add(path, "bfloat16 is not available with spec.model.embeddings; use float32")
    if (at_path(job, "spec", "model", "partitions") or 1) > 1:
        problems.add(path, "bfloat16 is not available with spec.model.partitions > 1; use float32, or one partition")
