"""A local run's output folder re-laid for another shard count (`distbelief reshard`, and
`distbelief run` with a new spec.parameterServers.shards): the protocol of
runtime/roles/reshard.py over the folder's places.
"""

from __future__ import annotations

import glob
import os
import shutil

from distbelief.operator.local import outputdir
from distbelief.operator.local.localpods import volume_dir
from distbelief.operator.render import podparts
from distbelief.runtime import contract, errors
from distbelief.runtime.roles.reshard import PLAN, Resharded, job_at, reshard, unchanged
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.wire.layout import Layout

WORK = "reshard"


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


def reshard_folder(output: str, shards: int) -> Resharded | str:
    """`distbelief reshard`: re-lay the checkpoints of the run in output for `shards` shards,
    reading the model from the config the run left there; or say why nothing changed."""
    configs = glob.glob(volume_dir(glob.escape(output), "*-ps-0", os.path.join(podparts.CONFIG_VOLUME,
                                                                               contract.CONFIG_KEY)))
    chiefs = [path for path in configs if os.path.isfile(path)]
    if len(chiefs) != 1:
        raise errors.ReshardError(f"{output}: not the output folder of one distbelief run "
                                  f"({len(chiefs)} chief configs under volumes/*/config)")
    config, after = job_at(chiefs[0], shards)
    with outputdir.locked(output):
        return reshard_output(output, config, after) or f"{output}: {unchanged(FolderPlaces(output, config.names), after)}"


def reshard_output(output: str, config: contract.JobConfig, after: Layout) -> Resharded | None:
    """A local run's output folder re-laid for after's shard count (its pods' folders, as many
    as it holds)."""
    places = FolderPlaces(output, config.names)
    pods = 1
    while os.path.isdir(places.live(pods)):
        pods += 1
    return reshard(places, pods, config, after)
