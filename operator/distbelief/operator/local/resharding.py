"""An output folder's checkpoints re-laid for another shard count, in steps a crash cannot
leave half done (`distbelief reshard`, and `distbelief run` with a new spec.parameterServers.shards).

The re-cut itself is the runtime's (params/rows/rowrecut.py: the dense state and the
embedding rows). Here the folders move, under
<output>/reshard/:

    staged/<pod>/   each new shard pod's checkpoint folder: its re-cut checkpoint and, for
                    the chief's, the files beside the old one (history, parameters)
    plan.json       written last, atomically: the commit point
    old/<pod>/      each old checkpoint folder, moved aside as its staged one moves in

Until plan.json exists the old folders are untouched (but for a damaged row file, set aside
as *.corrupt as a restore would), and an interrupted reshard is rolled back (reshard/
deleted). Once it exists the reshard is rolled forward: per pod, its folder
is moved aside, then its staged one moved into place, each rename checked before it is
made, so running recover() again after a crash at any point finishes it.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import shutil
import signal
from typing import Iterable

from distbelief.operator.local import outputdir
from distbelief.operator.local.localpods import volume_dir
from distbelief.operator.render import podparts
from distbelief.runtime import contract, errors
from distbelief.runtime.params.rows.rowrecut import recut
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.reshard import Recut
from distbelief.runtime.wire.layout import Layout

log = logging.getLogger(__name__)

WORK = "reshard"
PLAN = "plan.json"
# Testing only: SIGKILL the process after this many changes to the folder (tests/integration/test_reshard.py).
KILL_AFTER_ENV = "DISTBELIEF_RESHARD_KILL_AFTER"


@dataclasses.dataclass(frozen=True)
class Resharded:
    before: int
    after: int
    step: int

    def announcement(self) -> str:
        return f"resharded from {self.before} to {self.after} shards at step {self.step}"


class _Changes:
    """Counts the changes made to the folder (the kill point of the crash tests)."""

    def __init__(self) -> None:
        self.count = 0
        self.kill_after = int(os.environ.get(KILL_AFTER_ENV, "0") or 0)

    def made(self) -> None:
        self.count += 1
        if self.count == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


def recover(output: str) -> None:
    """Finish a reshard that reached its commit point, or undo one that did not."""
    work = os.path.join(output, WORK)
    if not os.path.isdir(work):
        return
    plan_path = os.path.join(work, PLAN)
    if os.path.exists(plan_path):
        with open(plan_path, encoding="utf-8") as f:
            plan = json.load(f)
        log.info("event=reshard_rolled_forward output=%s", output)
        _commit(output, plan["old"], plan["new"], _Changes())
    else:
        log.info("event=reshard_rolled_back output=%s", output)
        shutil.rmtree(work)


def layout_found(output: str, names: contract.JobNames, after: Layout) -> Layout | None:
    """The layout the folder's checkpoints were written for, if they are of after's model
    (only the shard count may differ); None for a folder without checkpoints or of another
    model. The count is no more than the folder's shard pods."""
    newest = checkpoint.list_checkpoints(_checkpoints(output, names.shard_pod(0)))
    if not newest:
        return None
    try:
        found = checkpoint.read_header(newest[0])["layout"]
    except (errors.CorruptCheckpoint, KeyError):
        return None
    pods = 1
    while os.path.isdir(_checkpoints(output, names.shard_pod(pods))):
        pods += 1
    candidates = (_layout(after, count) for count in range(1, pods + 1))
    return next((layout for layout in candidates if layout is not None and layout.hash == found), None)


def reshard(output: str, config: contract.JobConfig, after: Layout) -> Resharded | None:
    """Re-lay the folder's checkpoints of the job of config for after's shard count; None
    when they already are (or there are none). ReshardError when they cannot be."""
    recover(output)
    names = config.names
    before = layout_found(output, names, after)
    if before is None or before.shards == after.shards:
        return None
    copies = config.spec.parameter_servers.backups or os.path.isdir(_checkpoints(output, names.shard_pod(before.shards)))
    unsupported = ("shard copies (spec.parameterServers.backups)" if copies else
                   "Sandblaster (spec.training.algorithm)" if config.spec.training.algorithm == "sandblaster" else None)
    if unsupported:
        raise errors.ReshardError(f"{output}: resharding a job with {unsupported} is not supported; run it on "
                                  f"{before.shards} shards, or --fresh")
    old, folders = [], [_checkpoints(output, names.shard_pod(shard)) for shard in range(before.shards)]
    for shard, folder in enumerate(folders):
        ckpt = outputdir.newest(folder, copy=False)
        if ckpt is None:
            raise errors.ReshardError(f"shard {shard} has no checkpoint that verifies in {folder}")
        old.append(ckpt)
    new = recut(old, folders, before, after)
    changes = _Changes()
    old_pods = [names.shard_pod(s) for s in range(before.shards)]
    new_pods = [names.shard_pod(s) for s in range(after.shards)]
    _stage(output, old_pods, new_pods, new, changes)
    _commit(output, old_pods, new_pods, changes)
    step = old[0].step
    log.info("event=resharded output=%s before=%d after=%d step=%d", output, before.shards, after.shards, step)
    return Resharded(before.shards, after.shards, step)


def reshard_folder(output: str, shards: int) -> Resharded | None:
    """`distbelief reshard`: re-lay the checkpoints of the run in output for `shards` shards,
    reading the model from the config the run left there."""
    from distbelief.runtime.model.job import Job

    configs = glob.glob(volume_dir(glob.escape(output), "*-ps-0", os.path.join(podparts.CONFIG_VOLUME,
                                                                               contract.CONFIG_KEY)))
    chiefs = [path for path in configs if os.path.isfile(path)]
    if len(chiefs) != 1:
        raise errors.ReshardError(f"{output}: not the output folder of one distbelief run "
                                  f"({len(chiefs)} chief configs under volumes/*/config)")
    job = Job.load(chiefs[0])
    after = _layout(job.layout, shards)
    if after is None:
        raise errors.ReshardError(f"{job.layout.total} parameters in {len(job.layout.stages) + 1} stages cannot "
                                  f"be laid over {shards} shards")
    with outputdir.locked(output):
        return reshard(output, job.config, after)


def _stage(output: str, old_pods: list[str], new_pods: list[str], new: Iterable[Recut], changes: _Changes) -> None:
    work = os.path.join(output, WORK)
    for pod, shard in zip(new_pods, new):
        staged = os.path.join(work, "staged", pod)
        os.makedirs(staged)
        if pod in old_pods:
            _copy_beside(_checkpoints(output, pod), staged)
        checkpoint.write(os.path.join(staged, checkpoint.file_name(shard.header.step)), shard.header,
                         shard.pieces)
        changes.made()
    _write_plan(work, {"old": old_pods, "new": new_pods})
    changes.made()


def _copy_beside(folder: str, staged: str) -> None:
    """The files beside the checkpoints (the chief's history and parameters)."""
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not name.startswith((".", "step-")) and not name.endswith(".corrupt"):
            shutil.copy2(path, os.path.join(staged, name))


def _write_plan(work: str, plan: dict[str, list[str]]) -> None:
    path = os.path.join(work, PLAN)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(plan, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    checkpoint.fsync_folder(work)


def _commit(output: str, old_pods: list[str], new_pods: list[str], changes: _Changes) -> None:
    work = os.path.join(output, WORK)
    for pod in dict.fromkeys(old_pods + new_pods):
        live, aside, staged = (_checkpoints(output, pod), os.path.join(work, "old", pod),
                               os.path.join(work, "staged", pod))
        if pod in old_pods and os.path.isdir(live) and not os.path.isdir(aside):
            os.makedirs(os.path.dirname(aside), exist_ok=True)
            os.replace(live, aside)
            changes.made()
        if os.path.isdir(staged):
            os.makedirs(os.path.dirname(live), exist_ok=True)
            os.replace(staged, live)
            checkpoint.fsync_folder(os.path.dirname(live))
            changes.made()
    os.remove(os.path.join(work, PLAN))
    changes.made()
    shutil.rmtree(work)


def _layout(after: Layout, shards: int) -> Layout | None:
    try:
        return Layout.of(after.shapes, shards, after.stages)
    except ValueError:
        return None


def _checkpoints(output: str, pod: str) -> str:
    return volume_dir(output, pod, contract.CHECKPOINT_VOLUME)
