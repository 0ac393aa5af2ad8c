"""Local mode's output folder: one run at a time, and what an earlier run left in it.

A run holds an exclusive lock (flock) on a file in the folder for as long as it uses
it, so a second run into the same folder is refused instead of interleaving logs and
history. Before any pod starts, the folder's checkpoints are compared with the job: a
changed model or shard count is refused, a run to resume is announced with its step,
and a finished job is not trained again without --fresh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import os
import shutil
import time
from typing import Any, Iterator, Mapping

from distbelief.operator.local import report
from distbelief.operator.local.localpods import volume_dir
from distbelief.runtime import contract, errors
from distbelief.runtime.shard import checkpoint

LOCK_FILE = ".lock"
PROBE_GRACE_SECONDS = 0.2


@contextlib.contextmanager
def locked(output: str) -> Iterator[None]:
    """Hold the folder's lock; refuse in one line when another run holds it."""
    os.makedirs(output, exist_ok=True)
    fd = os.open(os.path.join(output, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _take(fd):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise errors.RuntimeFailure(f"{output} is in use by another distbelief run (pid {holder}): wait for it "
                                        "to end, or give this run another --output DIR") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def _take(fd: int) -> bool:
    """The exclusive lock, or False when a run holds it. A moment's wait tells a run apart
    from held()'s probe, which holds a shared lock for microseconds."""
    deadline = time.monotonic() + PROBE_GRACE_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def held(output: str) -> bool:
    """Whether a run holds the folder's lock now (it is running)."""
    try:
        fd = os.open(os.path.join(output, LOCK_FILE), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (closing drops a lock taken here)
    return False


def clear(output: str) -> None:
    """Everything an earlier run left (--fresh), but the lock this run holds."""
    for name in os.listdir(output):
        path = os.path.join(output, name)
        if name == LOCK_FILE:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


@dataclasses.dataclass(frozen=True)
class Earlier:
    """What an earlier run left: the chief's result, and the newest checkpoint of shard 0."""

    result: Mapping[str, Any] | None = None
    step: int | None = None
    saved_at: float | None = None

    def announcement(self) -> str | None:
        """The line that tells the user what this run will do with the folder."""
        if self.result:
            return (f"already {self.result['phase']} at step {self.result.get('globalStep', '?')}; "
                    "--fresh to train again")
        if self.step is not None and self.saved_at is not None:
            when = datetime.datetime.fromtimestamp(self.saved_at).strftime("%Y-%m-%d %H:%M:%S")
            return f"resuming from step {self.step} (checkpoints of {when})"
        return None


def earlier(output: str, config: contract.JobConfig, layout: int) -> Earlier:
    """What the folder holds for the job of config, whose parameters have the given layout
    hash; a ConfigError if its checkpoints belong to another model or shard count."""
    names = config.names
    newest = []
    for index in range(config.spec.parameter_servers.shards):
        folder = volume_dir(output, names.shard_pod(index), contract.CHECKPOINT_VOLUME)
        found = newest_with_time(folder)
        if found and found[0].layout != layout:
            raise errors.ConfigError(
                f"{folder}: the checkpoints there are of another model or shard count (layout "
                f"{found[0].layout:016x}, this job's is {layout:016x}): --fresh to start over, or --output DIR")
        newest.append(found)
    chief = volume_dir(output, names.shard_pod(0), contract.CHECKPOINT_VOLUME)
    ckpt, saved_at = newest[0] or (None, None)
    return Earlier(result=report.read_result(chief), step=ckpt.step if ckpt else None, saved_at=saved_at)


def newest(folder: str, *, copy: bool = True) -> checkpoint.Checkpoint | None:
    """The newest checkpoint in folder that verifies (without copy: its arrays are views of
    the file's bytes)."""
    found = newest_with_time(folder, copy=copy)
    return found[0] if found else None


def newest_with_time(folder: str, *, copy: bool = True) -> tuple[checkpoint.Checkpoint, float] | None:
    """The newest checkpoint in folder that verifies, and when it was written."""
    found = checkpoint.newest_verified(folder, copy=copy)
    return (found[0], os.path.getmtime(found[1])) if found else None
