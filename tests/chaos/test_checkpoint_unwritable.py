"""A live shard whose checkpoint folder stops being writable mid-run, for real.

Two ways the folder fails. Neither is mocked:
- disk full: the folder is a tiny tmpfs (mounted for the test; skipped where mounting is
  not allowed), filled up by a ballast file until the kernel answers ENOSPC;
- folder gone: the folder is moved away and a plain file is put in its place, so every
  write under it fails.
chmod would not do: the tests run as root, and root writes through any mode.

In both cases the shard must keep serving pulls and pushes and log
event=checkpoint_failed naming the folder. It must leave the checkpoints it wrote before
intact and verifiable, and write again at the next interval once the folder is usable.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.wire.layout import Layout

from support.shards import LiveShards, start_shards
from support.waiting import eventually

LAYOUT = Layout.of([("w", (64, 64))], shards=1)   # 16 KiB of parameters, 32 KiB a checkpoint
TMPFS_BYTES = 256 * 1024                          # room for the kept checkpoints and one more
EVERY = 0.2                                       # seconds between checkpoints
WAIT = 10.0


def _checkpointed_steps(folder: Path) -> list[int]:
    try:
        return [checkpoint.load(p).step for p in checkpoint.list_checkpoints(str(folder))]
    except FileNotFoundError:
        return []


class DiskFull:
    """A tmpfs for the folder; break() fills it with ballast, repair() deletes that."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        self.ballast = folder / "ballast"

    def break_(self) -> None:
        fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while True:
                os.write(fd, bytes(4096))  # unbuffered: ENOSPC arrives here, not at close
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        assert shutil.disk_usage(self.folder).free < 4096

    def repair(self) -> None:
        self.ballast.unlink()

    def close(self) -> None:
        subprocess.run(["umount", str(self.folder)], check=True)

    @property
    def files(self) -> Path:
        return self.folder


class FolderReplaced:
    """break() moves the folder aside and puts a plain file in its place; repair() undoes it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.aside = folder.with_name(folder.name + ".aside")
        self.broken = False

    def break_(self) -> None:
        self.folder.rename(self.aside)
        self.folder.write_text("not a folder\n")
        self.broken = True

    def repair(self) -> None:
        self.folder.unlink()
        self.aside.rename(self.folder)
        self.broken = False

    def close(self) -> None:
        pass

    @property
    def files(self) -> Path:
        return self.aside if self.broken else self.folder


@pytest.fixture(params=["disk-full", "folder-replaced-by-a-file"])
def failure(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DiskFull | FolderReplaced]:
    folder = tmp_path / "shard-0"  # what start_shards uses for shard 0
    made = DiskFull(folder) if request.param == "disk-full" else FolderReplaced(folder)
    try:
        yield made
    finally:
        made.close()


def _push(live: LiveShards, times: int) -> int:
    group = live.group()
    try:
        for _ in range(times):
            (reply,) = Float32Dense(group).push(np.full(LAYOUT.total, 0.01, dtype=np.float32), steps=[0], examples=1,
                                                loss=1.0)
        return reply.header.step
    finally:
        group.close()


def test_an_unwritable_checkpoint_folder_is_reported_and_training_goes_on(
        tmp_path: Path, failure: DiskFull | FolderReplaced, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="distbelief.runtime.shard.saves")  # the checkpoint schedule
    live = start_shards(tmp_path, LAYOUT, np.zeros(LAYOUT.total, np.float32), checkpoint_every=EVERY,
                        checkpoint_keep=2)
    server = live.shards[0]
    folder = Path(server.settings.checkpoint_dir)
    try:
        step = _push(live, 3)
        eventually(lambda: step in _checkpointed_steps(folder), WAIT, what=f"a checkpoint of step {step}")
        before = {p: Path(p).read_bytes() for p in checkpoint.list_checkpoints(str(folder))}

        failure.break_()
        step = _push(live, 2)
        failed = eventually(lambda: [r for r in caplog.records if "event=checkpoint_failed" in r.getMessage()],
                            WAIT, what="event=checkpoint_failed")
        message = failed[0].getMessage()
        assert f"folder={folder}" in message and f"step={step}" in message
        reason = "No space left on device" if isinstance(failure, DiskFull) else f"{folder} is not a folder"
        assert reason in message
        assert failed[0].levelname == "ERROR" and "\n" not in message

        # Training goes on: the shard answers and applies updates.
        assert _push(live, 2) == step + 2
        out = np.empty(LAYOUT.total, dtype=np.float32)
        (reply,) = Float32Dense(live.group()).pull(out)
        assert reply.header.step == step + 2
        # What was written before is untouched and still verifies; no partial file is left.
        kept = {os.path.join(str(folder), os.path.basename(p)): Path(os.path.join(str(failure.files),
                                                                                   os.path.basename(p))).read_bytes()
                for p in before}
        assert kept == before
        assert not [n for n in os.listdir(failure.files) if n.endswith(".tmp")]
        for name in before:
            checkpoint.load(os.path.join(str(failure.files), os.path.basename(name)))

        failure.repair()
        eventually(lambda: step + 2 in _checkpointed_steps(folder), WAIT,
                   what=f"a checkpoint of step {step + 2} after repair")
        eventually(lambda: any("event=checkpoint_resumed" in r.getMessage() for r in caplog.records), WAIT,
                   what="event=checkpoint_resumed")
        assert max(_checkpointed_steps(folder)) == step + 2
    finally:
        live.stop()
    restored = checkpoint.restore_latest(str(folder), layout=LAYOUT.hash, shard=0)
    assert restored is not None and restored.step == step + 2
