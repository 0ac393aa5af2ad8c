"""`distbelief reshard-claims`, the role of the operator's reshard Job: checkpoints re-laid
for another shard count, in steps a crash cannot leave half done, on a cluster job's
checkpoint claims (ClaimPlaces), or in a local run's output folder (the same protocol over
operator/local/resharding.py's places).

The re-cut itself is the runtime's (params/rows/rowrecut.py: the dense state and the
embedding rows). Here the folders move. For each shard pod, its place (Places) has

    live        its checkpoint folder, as its shard reads it
    staged      its re-cut checkpoint and, for the chief's, the files beside the old one
                (history, parameters), written first
    aside       where its old checkpoint folder goes as the staged one moves in

and one plan, written last and atomically, is the commit point. Until it exists the old
folders are untouched (but for a damaged row file, set aside as *.corrupt as a restore
would), and an interrupted reshard is rolled back (the work folders deleted). Once it
exists the reshard is rolled forward: per pod, its folder is moved aside, then its staged
one moved into place, each move checked before it is made, so running recover() again
after a crash at any point finishes it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
from typing import Any, Iterable, Protocol

from distbelief.runtime import contract, errors
from distbelief.runtime.model.job import Job
from distbelief.runtime.params.rows.rowrecut import recut
from distbelief.runtime.shard import checkpoint, journal
from distbelief.runtime.shard.reshard import Recut
from distbelief.runtime.wire.layout import Layout

log = logging.getLogger(__name__)

# Testing only: SIGKILL the process after this many changes to the folders (tests/integration/test_reshard*.py).
KILL_AFTER_ENV = "DISTBELIEF_RESHARD_KILL_AFTER"
PLAN = "plan.json"


class Places(Protocol):
    """Where a reshard finds each shard pod's checkpoint folder, stages its new one and sets
    the old one aside; every move is made only if it has not been, so that a reshard rolled
    forward after a crash repeats none."""

    plan: str         # the commit point
    start_over: str   # how a user starts the job afresh instead

    def live(self, pod: int) -> str: ...

    def staged(self, pod: int) -> str: ...

    def working(self) -> bool:
        """Whether a reshard left work here (staged folders, a plan, folders set aside)."""

    def move_aside(self, pod: int) -> bool:
        """Set the pod's old checkpoint folder aside, unless it is; whether a move was made."""

    def move_in(self, pod: int) -> bool:
        """Move the pod's staged folder into place, unless it is; whether a move was made."""

    def clear(self) -> None:
        """Delete the work: what was staged and what was set aside."""


class ClaimPlaces:
    """A cluster job's checkpoint claims, mounted in pod order: a claim's root is its shard's
    checkpoint folder, so the work is on each claim, under .reshard/ (staged/, old/), and
    its entries move one by one; the plan is on the first claim. A claim's `old/` is
    complete once its marker is written, and its `staged/` moved in once it is gone."""

    WORK = ".reshard"
    KEEP = (WORK, "lost+found")     # a file system's own entries stay where they are

    def __init__(self, claims: list[str]) -> None:
        self.claims = claims
        self.plan = os.path.join(self._work(0), PLAN)
        self.start_over = "create a new job"

    def __str__(self) -> str:
        return ",".join(self.claims)

    def live(self, pod: int) -> str:
        return self.claims[pod]

    def staged(self, pod: int) -> str:
        return os.path.join(self._work(pod), "staged")

    def working(self) -> bool:
        return any(os.path.isdir(self._work(pod)) for pod in range(len(self.claims)))

    def move_aside(self, pod: int) -> bool:
        aside = os.path.join(self._work(pod), "old")
        done = aside + ".done"
        if os.path.exists(done):
            return False
        os.makedirs(aside, exist_ok=True)
        self._move_entries(self.live(pod), aside, skip=self.KEEP)
        with open(done, "wb") as f:
            os.fsync(f.fileno())
        checkpoint.fsync_folder(self._work(pod))
        return True

    def move_in(self, pod: int) -> bool:
        staged = os.path.join(self._work(pod), "staged")
        if not os.path.isdir(staged):
            return False
        self._move_entries(staged, self.live(pod))
        os.rmdir(staged)
        checkpoint.fsync_folder(self._work(pod))
        return True

    def clear(self) -> None:
        for pod in range(len(self.claims)):
            shutil.rmtree(self._work(pod), ignore_errors=True)

    def _work(self, pod: int) -> str:
        return os.path.join(self.claims[pod], self.WORK)

    @staticmethod
    def _move_entries(source: str, target: str, skip: tuple[str, ...] = ()) -> None:
        for name in sorted(os.listdir(source)):
            if name not in skip:
                os.replace(os.path.join(source, name), os.path.join(target, name))
        checkpoint.fsync_folder(source)
        checkpoint.fsync_folder(target)


@dataclasses.dataclass(frozen=True)
class Resharded:
    before: int
    after: int
    step: int

    def announcement(self) -> str:
        return f"resharded from {self.before} to {self.after} shards at step {self.step}"


class _Changes:
    """Counts the changes made to the folders (the kill point of the crash tests)."""

    def __init__(self) -> None:
        self.count = 0
        self.kill_after = int(os.environ.get(KILL_AFTER_ENV, "0") or 0)

    def made(self) -> None:
        self.count += 1
        if self.count == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


def recover(places: Places) -> None:
    """Finish a reshard that reached its commit point, or undo one that did not."""
    if not places.working():
        return
    if os.path.exists(places.plan):
        with open(places.plan, encoding="utf-8") as f:
            plan = json.load(f)
        log.info("event=reshard_rolled_forward where=%s", places)
        _commit(places, _count(plan["old"]), _count(plan["new"]), _Changes())
    else:
        log.info("event=reshard_rolled_back where=%s", places)
        places.clear()


def _count(pods: int | list[str]) -> int:
    """A plan's pod count (a list of the pods' names in plans written before counts)."""
    return pods if isinstance(pods, int) else len(pods)


def layout_found(places: Places, pods: int, after: Layout) -> Layout | None:
    """The layout the checkpoints were written for, if they are of after's model (only the
    shard count may differ); None for places without checkpoints or of another model. The
    count is no more than pods."""
    found = _newest_header(places).get("layout")
    candidates = (_layout(after, count) for count in range(1, pods + 1))
    return next((layout for layout in candidates if layout is not None and layout.hash == found), None)


def _newest_header(places: Places) -> dict[str, Any]:
    """The header of shard 0's newest checkpoint; empty when it has none, or none that reads."""
    newest = checkpoint.list_checkpoints(places.live(0))
    try:
        return checkpoint.read_header(newest[0]) if newest else {}
    except errors.CorruptCheckpoint:
        return {}


def reshard(places: Places, pods: int, config: contract.JobConfig, after: Layout) -> Resharded | None:
    """Re-lay the checkpoints of the job of config, in the first of pods places, for after's
    shard count; None when they already are (or there are none). ReshardError when they
    cannot be. With shard copies, pod o is copy o // shards of shard o % shards: each shard
    is read from its copy with the newest checkpoint, and every copy of a new shard gets
    its re-cut checkpoint."""
    recover(places)
    before = layout_found(places, pods, after)
    if before is None and not any(checkpoint.list_checkpoints(places.live(pod)) for pod in range(pods)):
        _refuse_unreplayed(places, [(places.live(pod), None) for pod in range(pods)])
    if before is None or before.shards == after.shards:
        return None
    copies = config.spec.parameter_servers.copies
    old_pods = before.shards * copies
    if config.spec.training.algorithm == "sandblaster":
        raise errors.ReshardError(f"{places}: resharding a Sandblaster job is not supported; run it on "
                                  f"{before.shards} shards, or {places.start_over}")
    if pods > old_pods and checkpoint.list_checkpoints(places.live(old_pods)):
        raise errors.ReshardError(f"{places}: holds checkpoints of more than {before.shards} shards x {copies} "
                                  "copies (spec.parameterServers.backups changed?); reshard with the backups it ran "
                                  f"with, or {places.start_over}")
    old, folders = zip(*(_newest_copy(places, shard, before.shards, copies) for shard in range(before.shards)))
    _refuse_unreplayed(places, zip(folders, old))
    changes = _Changes()
    _stage(places, old_pods, recut(old, folders, before, after), after, copies, changes)
    _commit(places, old_pods, after.shards * copies, changes)
    step = old[0].step
    log.info("event=resharded where=%s before=%d after=%d copies=%d step=%d", places, before.shards, after.shards,
             copies, step)
    return Resharded(before.shards, after.shards, step)


def unchanged(places: Places, after: Layout) -> str:
    """Why a reshard changed nothing: the places are laid for after's count already (at the
    step of shard 0's newest checkpoint), hold no checkpoint, or one of another model."""
    header = _newest_header(places)
    if not header:
        return "no checkpoints to re-lay"
    if header.get("layout") != after.hash:
        return (f"nothing re-laid: the newest checkpoint in {places.live(0)} is of another model, or of more shards "
                "than claims mounted")
    return f"already laid over {after.shards} shards, at step {header.get('step')}"


def _refuse_unreplayed(places: Places, newest: Iterable[tuple[str, checkpoint.Checkpoint | None]]) -> None:
    """ReshardError when a shard's journal (spec.parameterServers.journal) holds commands its
    newest checkpoint (None: it has none) does not, as after a SIGKILL: the shard acknowledged
    them, and only a replay by that shard, on the old layout, brings them back."""
    for folder, ckpt in newest:
        seq = ckpt.meta.get(journal.SEQ_KEY) if ckpt else 0
        if not isinstance(seq, int):   # a checkpoint from before the journal was on: a start sets it aside
            continue
        unreplayed = journal.commands_after(os.path.join(folder, journal.FOLDER), seq)
        if unreplayed:
            raise errors.ReshardError(
                f"{places}: the shard journal in {folder} holds {unreplayed} acknowledged commands after its newest "
                f"checkpoint ({f'step {ckpt.step}' if ckpt else 'none'}), which only its shard can replay: run the "
                "job on the shard count it ran with until it stops with a checkpoint (a suspend does), then reshard")


def _newest_copy(places: Places, shard: int, shards: int, copies: int) -> tuple[checkpoint.Checkpoint, str]:
    """The shard's newest checkpoint over its copies (a backup may lag its primary), and its folder."""
    found = [(ckpt, folder) for folder in (places.live(copy * shards + shard) for copy in range(copies))
             if (ckpt := _newest(folder)) is not None]
    if not found:
        raise errors.ReshardError(f"shard {shard} has no checkpoint that verifies in {places.live(shard)}"
                                  + (f" nor in its {copies - 1} copies'" if copies > 1 else ""))
    return max(found, key=lambda pair: pair[0].step)


def reshard_claims(claims: list[str], config_path: str, shards: int) -> Resharded | str:
    """`distbelief reshard-claims`: a cluster job's checkpoint claims, mounted in shard pod
    order (as many as the larger count), re-laid for `shards` shards; or why nothing changed."""
    config, after = job_at(config_path, shards)
    needed = after.shards * config.spec.parameter_servers.copies
    if len(claims) < needed:
        raise errors.ReshardError(f"{shards} shards need {needed} checkpoint claims; {len(claims)} mounted")
    places = ClaimPlaces(claims)
    return reshard(places, len(claims), config, after) or unchanged(places, after)


def job_at(config_path: str, shards: int) -> tuple[contract.JobConfig, Layout]:
    """The job of the config file, and its layout over `shards` shards."""
    job = Job.load(config_path)
    after = _layout(job.layout, shards)
    if after is None:
        raise errors.ReshardError(f"{job.layout.total} parameters in {len(job.layout.stages) + 1} stages cannot "
                                  f"be laid over {shards} shards")
    return job.config, after


def _newest(folder: str) -> checkpoint.Checkpoint | None:
    found = checkpoint.newest_verified(folder, copy=False)
    return found[0] if found else None


def _stage(places: Places, old_pods: int, new: Iterable[Recut], after: Layout, copies: int,
           changes: _Changes) -> None:
    """Each new shard pod's checkpoint (every copy of a shard the same), then the plan."""
    for shard in new:
        for copy in range(copies):
            pod = copy * after.shards + shard.header.shard
            staged = places.staged(pod)
            os.makedirs(staged)
            if pod < old_pods:
                _copy_beside(places.live(pod), staged)
            checkpoint.write(os.path.join(staged, checkpoint.file_name(shard.header.step)), shard.header,
                             shard.pieces)
            changes.made()
    _write_plan(places.plan, {"old": old_pods, "new": after.shards * copies})
    changes.made()


def _copy_beside(folder: str, staged: str) -> None:
    """The files beside the checkpoints (the chief's history and parameters)."""
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not name.startswith((".", "step-")) and not name.endswith(".corrupt"):
            shutil.copy2(path, os.path.join(staged, name))


def _write_plan(path: str, plan: dict[str, int]) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(plan, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    checkpoint.fsync_folder(os.path.dirname(path))


def _commit(places: Places, old_pods: int, new_pods: int, changes: _Changes) -> None:
    for pod in range(max(old_pods, new_pods)):
        if pod < old_pods and places.move_aside(pod):
            changes.made()
        if places.move_in(pod):
            changes.made()
    os.remove(places.plan)
    changes.made()
    places.clear()


def _layout(after: Layout, shards: int) -> Layout | None:
    try:
        return Layout.of(after.shapes, shards, after.stages)
    except ValueError:
        return None
