"""A shard's write-ahead journal (spec.parameterServers.journal): every command it applies,
on its own volume, on disk before the reply that acknowledges it leaves; replayed on top of
the newest checkpoint when the shard starts again.

Without backups, a SIGKILLed shard loses what it applied since its newest checkpoint (its
replicas' pushes reveal how much: losses.py). With the journal, what it acknowledged is on
disk: every reply (a pull's too) waits until each command applied before it is, so no
replica sees a state that a restart would not bring back. The commands applied between two
turns of the serving loop share one fdatasync.

The journal takes the core's replication slot (plugin.Replication, which copies take when
there are backups) and a plugin's place in the checkpoints: each checkpoint records the
number of the last command it holds (SEQ_KEY). Replay applies the commands after it through
the core's own path, as a backup applies what its primary forwards (copies/following.py):
under their sender's identity, at the time the shard first took them. So the resend record
knows them too, and a replica that sends one again is answered, not applied twice.

Files: <checkpoints>/journal/<number of its first command>.log, a new one after each
checkpoint. A file goes once two checkpoints that landed hold all of it (restore falls back
to the one before the newest when the newest does not read). A record is
    "DBJ1" | body bytes (u64) | crc32 of the body (u32) | body
    body: meta bytes (u32) | meta JSON {seq, step, user, peer, at} | per frame: bytes (u64), frame
and nothing in it is pickled. The first record that does not read whole (torn by the kill,
or damaged) ends the replay: as a tail it was never acknowledged. The bytes from it on are
kept beside the file (<file>.rejected) and cut from it, so that appends go on from a record.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import struct
import time
import zlib
from typing import Any, BinaryIO, Iterator, Mapping

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.core import Shard
from distbelief.runtime.shard.plugin import Handler, SingleCopy
from distbelief.runtime.transport.interface import Incoming
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import OpSpec

log = logging.getLogger(__name__)

SEQ_KEY = checkpoint.JOURNAL_SEQ
FOLDER = "journal"
MAGIC = b"DBJ1"
RECORD = struct.Struct("<4sQI")
META_BYTES = struct.Struct("<I")
FRAME_BYTES = struct.Struct("<Q")
SUFFIX = ".log"


@dataclasses.dataclass(frozen=True)
class Record:
    seq: int
    step: int          # the shard's step once the command was applied
    user: str | None
    peer: bytes
    at: float          # when the shard first took it (Shard.command_time)
    frames: list[memoryview]   # views of the record's body, read once


class Journal(SingleCopy):
    """The shard's journal: a plugin for what its checkpoints record, and its replication slot
    for what a reply waits on. attach() it, serve_copies() it, then replay() after restore()."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.folder = os.path.join(shard.settings.checkpoint_dir, FOLDER)
        self.seq = 0         # the last command applied
        self.synced = 0      # the last command on disk
        self._file: BinaryIO | None = None
        self._replaying = False
        self._serving = False
        self._saving: tuple[int, int] | None = None   # (seq, step) of the checkpoint being written
        self._landed: list[int] = []                  # seqs of the last two checkpoints that landed
        self.replayed = 0

    # -- a plugin: the checkpoints' record -------------------------------------------------------

    def handlers(self) -> Mapping[OpSpec, Handler]:
        return {}

    def repeat_handlers(self) -> Mapping[OpSpec, Handler]:
        return {}

    def array_values(self) -> int:
        return 0

    def checkpoint_state(self, *, transfer: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The checkpoint holds every command so far: the next one starts a file of its own."""
        self._close_file()
        self._saving = (self.seq, self.shard.step)
        return {}, {SEQ_KEY: self.seq}

    def restore(self, ckpt: checkpoint.Checkpoint) -> None:
        """The state of a checkpoint. At start, replay() goes on from it; while serving (the state
        went back to a checkpoint), what the journal holds after it is undone and set aside."""
        seq = ckpt.meta.get(SEQ_KEY)
        if self._serving or not isinstance(seq, int):   # or written before the journal was on
            self._close_file()
            self._set_aside(self._segments(), "undone" if self._serving else "unclaimed")
        self.seq = self.synced = seq if isinstance(seq, int) else 0
        self._saving, self._landed = None, []

    # -- replication slot: replies wait for the disk ---------------------------------------------

    def replicate(self, incoming: Incoming) -> None:
        self.seq += 1
        if self._replaying:
            return
        meta = json.dumps({"seq": self.seq, "step": self.shard.step, "user": incoming.user,
                           "peer": incoming.peer.hex(), "at": self.shard.command_time}).encode()
        pieces: list[Any] = [META_BYTES.pack(len(meta)), meta]
        for frame in incoming.frames:
            pieces += [FRAME_BYTES.pack(len(frame)), frame]
        crc, size = 0, 0
        for piece in pieces:
            crc, size = zlib.crc32(piece, crc), size + len(piece)
        try:
            file = self._file or self._open(self.seq)
            file.write(RECORD.pack(MAGIC, size, crc))
            for piece in pieces:
                file.write(piece)
        except OSError as exc:
            raise self._failure("write to", exc) from exc
        self.shard.metrics.journal_bytes.inc(RECORD.size + size)

    def reply_tag(self) -> Any:
        return self.seq if self.seq > self.synced else None

    def released(self, tag: Any) -> bool | None:
        return tag <= self.synced

    def tick(self) -> None:
        if self.seq > self.synced:
            self._sync()
        self._drop_covered()

    def close(self) -> None:
        if self.seq > self.synced and self._file is not None:
            self._sync()
        self._close_file()

    def stats(self) -> dict[str, Any]:
        return {"journal": {"seq": self.seq, "synced": self.synced, "replayed": self.replayed}}

    # -- replay ----------------------------------------------------------------------------------

    def replay(self) -> int:
        """Apply the commands after the restored state's, in order; how many. Stops at the first
        that does not read, does not follow on, or does not end where it did the first time."""
        base, problem = self.seq, None
        self._replaying = True
        try:
            segments = self._segments()
            for n, path in enumerate(segments):
                problem = self._replay_file(path, last=n == len(segments) - 1)
                if problem:
                    self._set_aside(segments[n + 1:], "unreplayed")
                    break
        finally:
            self._replaying, self._serving = False, True
        self.synced = self.seq
        self.replayed = self.seq - base
        if self.replayed:
            self.shard.lost.new_life(self.shard.step)   # what replicas pulled up to here is not lost
        if problem:
            log.error("event=journal_replay_stopped shard=%d seq=%d step=%d reason=%r", self.shard.index, self.seq,
                      self.shard.step, problem)
        log.info("event=journal_replayed shard=%d from_seq=%d commands=%d step=%d", self.shard.index, base,
                 self.replayed, self.shard.step)
        return self.replayed

    def _replay_file(self, path: str, *, last: bool) -> str | None:
        """Replay one file's records after self.seq; what stopped it (None: the whole file, or
        all of the last file but the record a kill tore, which was never acknowledged)."""
        with open(path, "rb") as file:
            good, problem = 0, None
            for record, end in _read_records(file):
                if record is None:
                    problem = None if last else f"{os.path.basename(path)}: a record at byte {good} does not read whole"
                    break
                if record.seq > self.seq:
                    problem = self._apply(record)
                    if problem:
                        break
                good = end
            size = file.seek(0, os.SEEK_END)
        if good < size:
            self._cut(path, good)
        return problem

    def _apply(self, record: Record) -> str | None:
        if record.seq != self.seq + 1:
            return f"command {record.seq} does not follow command {self.seq} (a file is missing)"
        header = protocol.unpack_header(record.frames[0])
        self.shard.answer(header, Incoming(peer=record.peer, user=record.user, frames=record.frames), taken_at=record.at)
        if self.seq != record.seq or self.shard.step != record.step:   # a refusal it was not the first time
            return (f"command {record.seq} ended at step {self.shard.step} (command {self.seq}), "
                    f"not at step {record.step} as when first applied")
        return None

    # -- files -----------------------------------------------------------------------------------

    def _segments(self) -> list[str]:
        return journal_files(self.folder)

    def _open(self, seq: int) -> BinaryIO:
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"{seq:012d}{SUFFIX}")
        if os.path.exists(path):
            self._set_aside([path], "replaced")
        self._file = open(path, "wb")
        checkpoint.fsync_folder(self.folder)   # the file's name is on disk before anything in it is acknowledged
        return self._file

    def _sync(self) -> None:
        assert self._file is not None
        try:
            self._file.flush()
            os.fdatasync(self._file.fileno())
        except OSError as exc:
            raise self._failure("flush", exc) from exc
        self.synced = self.seq
        self.shard.metrics.journal_syncs.inc()

    def _close_file(self) -> None:
        if self._file is not None:
            if self.seq > self.synced:
                self._sync()
            self._file.close()
            self._file = None

    def _drop_covered(self) -> None:
        """After a checkpoint landed: remove the files that it and the one before hold whole."""
        if self._saving is None:
            return
        (seq, step), self._saving = self._saving, None
        saves = self.shard.saves
        if saves.failures or saves.last[1] != step:
            return
        self._landed = [*self._landed, seq][-2:]
        if len(self._landed) < 2:
            return
        segments = self._segments()
        for path, following in zip(segments, segments[1:]):
            if _first_seq(following) - 1 <= self._landed[0]:
                os.remove(path)

    def _cut(self, path: str, good: int) -> None:
        with open(path, "rb") as file, open(path + ".rejected", "ab") as kept:
            file.seek(good)
            shutil.copyfileobj(file, kept)
        with open(path, "r+b") as file:   # cut for good before the next record is acknowledged after it
            file.truncate(good)
            os.fsync(file.fileno())
        log.warning("event=journal_tail_cut shard=%d file=%s at_byte=%d kept=%s.rejected", self.shard.index,
                    os.path.basename(path), good, os.path.basename(path))

    def _set_aside(self, paths: list[str], why: str) -> None:
        for path in paths:
            os.replace(path, f"{path}.{why}-{time.time_ns()}")
            log.warning("event=journal_set_aside shard=%d file=%s reason=%s", self.shard.index,
                        os.path.basename(path), why)

    def _failure(self, what: str, exc: OSError) -> errors.RuntimeFailure:
        # Nothing more may be acknowledged: stop, and be restarted from what is on disk.
        return errors.RuntimeFailure(f"shard {self.shard.index}: cannot {what} its journal in {self.folder}: {exc}")


def journal_files(folder: str) -> list[str]:
    """The journal's files in folder, oldest first."""
    try:
        names = [n for n in os.listdir(folder) if n.endswith(SUFFIX) and n[:-len(SUFFIX)].isdigit()]
    except FileNotFoundError:
        return []
    return [os.path.join(folder, n) for n in sorted(names, key=lambda n: int(n[:-len(SUFFIX)]))]


def commands_after(folder: str, seq: int) -> int:
    """How many commands the journal in folder holds after command seq: what a replay on top
    of a checkpoint holding seq would apply (up to the first record that does not read)."""
    count = 0
    for path in journal_files(folder):
        with open(path, "rb") as file:
            for record, _ in _read_records(file):
                if record is None:
                    return count
                count += record.seq > seq
    return count


def _read_records(file: BinaryIO) -> Iterator[tuple[Record | None, int]]:
    """Each record of a file and the byte after it; (None, at) for one that does not read whole."""
    size = file.seek(0, os.SEEK_END)
    file.seek(0)
    at = 0
    while at < size:
        head = file.read(RECORD.size)
        if len(head) < RECORD.size:
            yield None, at
            return
        magic, body_bytes, crc = RECORD.unpack(head)
        if magic != MAGIC or body_bytes > size - at - RECORD.size:
            yield None, at
            return
        body = file.read(body_bytes)
        record = _parse(body) if zlib.crc32(body) == crc else None
        at += RECORD.size + body_bytes
        yield record, at
        if record is None:
            return


def _parse(body: bytes) -> Record | None:
    try:
        (meta_bytes,) = META_BYTES.unpack_from(body)
        meta = json.loads(body[META_BYTES.size:META_BYTES.size + meta_bytes])
        frames, at, view = [], META_BYTES.size + meta_bytes, memoryview(body)
        while at < len(body):
            (frame_bytes,) = FRAME_BYTES.unpack_from(body, at)
            at += FRAME_BYTES.size
            frames.append(view[at:at + frame_bytes])
            at += frame_bytes
        if at != len(body) or not frames:
            return None
        return Record(seq=int(meta["seq"]), step=int(meta["step"]), user=meta["user"], peer=bytes.fromhex(meta["peer"]),
                      at=float(meta["at"]), frames=frames)
    except (struct.error, ValueError, KeyError, TypeError):
        return None


def _first_seq(path: str) -> int:
    return int(os.path.basename(path)[:-len(SUFFIX)])

