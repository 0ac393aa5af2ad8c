"""Where a reshard (resharding.py) finds each shard pod's checkpoint folder, stages its new
one, and sets the old one aside: in a local run's output folder, or on a cluster job's
checkpoint claims. Every move is made only if it has not been made, so that a reshard
rolled forward after a crash repeats none.
"""

from __future__ import annotations

import os
import shutil
from typing import Protocol

from distbelief.operator.local.localpods import volume_dir
from distbelief.runtime import contract
from distbelief.runtime.shard import checkpoint

WORK = "reshard"
PLAN = "plan.json"


class Places(Protocol):
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


class FolderPlaces:
    """A local run's output folder: each pod's checkpoint folder is one of its volumes, and
    the work is under <output>/reshard/ (staged/<pod>/, old/<pod>/, plan.json), so that
    every move is one rename."""

    def __init__(self, output: str, names: contract.JobNames) -> None:
        self.output, self.names = output, names
        self.work = os.path.join(output, WORK)
        self.plan = os.path.join(self.work, PLAN)
        self.start_over = "--fresh"

    def __str__(self) -> str:
        return self.output

    def live(self, pod: int) -> str:
        return volume_dir(self.output, self.names.shard_pod(pod), contract.CHECKPOINT_VOLUME)

    def staged(self, pod: int) -> str:
        return os.path.join(self.work, "staged", self.names.shard_pod(pod))

    def working(self) -> bool:
        return os.path.isdir(self.work)

    def move_aside(self, pod: int) -> bool:
        live, aside = self.live(pod), os.path.join(self.work, "old", self.names.shard_pod(pod))
        if not os.path.isdir(live) or os.path.isdir(aside):
            return False
        os.makedirs(os.path.dirname(aside), exist_ok=True)
        os.replace(live, aside)
        return True

    def move_in(self, pod: int) -> bool:
        staged, live = self.staged(pod), self.live(pod)
        if not os.path.isdir(staged):
            return False
        os.makedirs(os.path.dirname(live), exist_ok=True)
        os.replace(staged, live)
        checkpoint.fsync_folder(os.path.dirname(live))
        return True

    def clear(self) -> None:
        shutil.rmtree(self.work)


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
