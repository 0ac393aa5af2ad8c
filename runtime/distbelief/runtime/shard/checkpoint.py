"""Atomic, self-checking checkpoints of one shard.

File layout (one file per checkpoint, `step-<12 digits>.ckpt`):

    b"DBCKPT01" | u64 header length | JSON header | raw float32 arrays, back to back

The header names the step, the layout hash, the shard, each array and its length, free
metadata, and a SHA-256 over the rest of the header (as JSON) and the array bytes, so a
damaged header cannot pass for a checkpoint of another step, layout or shard. It is padded
with spaces so that the arrays start on a 64-byte boundary: a large file read without copy
is mapped, its arrays aligned (a file written before the padding is read whole). A file is
written under a temporary name (the arrays hashed as they are written, the header last),
fsynced, renamed into place and the folder fsynced, so a crash leaves either the old set or
the new one. On restore the newest file that verifies
(and whose plugins can load it: a file it names may be damaged) wins; one that does not is
reported and renamed aside (never deleted), and the one before it is used. write() and
load() also serve files of other names (params/rows/rowcheckpoint.py's row files); encode() and
decode() the same bytes in memory (replication.py's state transfer). The temporary of a
write that a crash interrupted is removed at restore.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import io
import json
import logging
import mmap
import os
import struct
from typing import Any, Callable, Iterator

import numpy as np

from distbelief.runtime import errors

log = logging.getLogger(__name__)

MAGIC = b"DBCKPT01"
LENGTH = struct.Struct("<Q")
MAX_HEADER_BYTES = 16 << 20  # its metadata holds each peer's last command, with its reply (resends.py)
SUFFIX = ".ckpt"
TEMPORARY = ".tmp"
DTYPE = np.dtype("<f4")
ALIGN = 64
MAP_AT_LEAST = 1 << 20  # a smaller file is read: mapping costs more than it saves
CHUNK_BYTES = 4 << 20   # written as hashed, while still in the CPU's cache


@dataclasses.dataclass
class Checkpoint:
    step: int
    layout: int
    shard: int
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    sha256: str = ""  # of a checkpoint read from a file


class Gathered:
    """Rows of a larger array (`source`, [n, ...]) taken as they are written: a re-cut's
    piece, gathered a chunk at a time through one small buffer, so that no copy of a new
    shard's whole state is ever held."""

    def __init__(self, source: np.ndarray, rows: np.ndarray) -> None:
        self.source, self.rows = source, rows
        self.row_values = int(np.prod(source.shape[1:], dtype=np.int64))
        self.size = rows.size * self.row_values

    def chunks(self) -> Iterator[np.ndarray]:
        step = max(1, CHUNK_BYTES // max(1, self.row_values * self.source.itemsize))
        buffer = np.empty((min(step, self.rows.size), *self.source.shape[1:]), self.source.dtype)
        for start in range(0, self.rows.size, step):
            rows = self.rows[start:start + step]
            np.take(self.source, rows, axis=0, out=buffer[:rows.size], mode="clip")  # clip: not buffered
            yield buffer[:rows.size]


# A checkpoint's arrays, each as pieces laid end to end (write(): a re-cut's, not joined).
Pieces = dict[str, list["np.ndarray | Gathered"]]


def file_name(step: int) -> str:
    return f"step-{step:012d}{SUFFIX}"


def encode(ckpt: Checkpoint, pieces: Pieces | None = None) -> list[bytes | memoryview]:
    """ckpt in the file format, as consecutive parts (the arrays are not copied, gathered
    pieces are); with pieces, those are its arrays (as write() takes them)."""
    body = _body(ckpt, pieces)
    arrays = [_as_f32(piece).data if isinstance(piece, np.ndarray)
              else b"".join(bytes(_as_f32(chunk)) for chunk in piece.chunks()) for piece in _laid(ckpt, pieces)]
    digest = hashlib.sha256(json.dumps(body).encode())
    for array in arrays:
        digest.update(array)
    return [_head(body, digest.hexdigest()), *arrays]


def _pieces(ckpt: Checkpoint, pieces: Pieces | None) -> Pieces:
    """The arrays to write, each as its pieces: pieces if given, else ckpt's, whole."""
    return pieces if pieces is not None else {name: [array] for name, array in ckpt.arrays.items()}


def _laid(ckpt: Checkpoint, pieces: Pieces | None) -> list[np.ndarray | Gathered]:
    return [piece for parts in _pieces(ckpt, pieces).values() for piece in parts]


def _body(ckpt: Checkpoint, pieces: Pieces | None) -> dict[str, Any]:
    """The header but its SHA-256."""
    return {"step": ckpt.step, "layout": ckpt.layout, "shard": ckpt.shard, "meta": ckpt.meta,
            "arrays": [[name, sum(int(piece.size) for piece in parts)] for name, parts in _pieces(ckpt, pieces).items()]}


def _head(body: dict[str, Any], sha256: str) -> bytes:
    """The file's bytes before its arrays: padded so that they start aligned, and as long
    for any SHA-256 (write() lays a stand-in first and the real one last)."""
    header = json.dumps({**body, "sha256": sha256}).encode()
    header += b" " * (-(len(MAGIC) + LENGTH.size + len(header)) % ALIGN)
    return MAGIC + LENGTH.pack(len(header)) + header


def _chunks(piece: np.ndarray | Gathered) -> Iterator[memoryview]:
    """A piece's float32 bytes, a chunk at a time: hashed and written while in the cache."""
    if isinstance(piece, Gathered):
        yield from (_as_f32(chunk).data.cast("B") for chunk in piece.chunks())
        return
    flat = _as_f32(piece).data.cast("B")
    for start in range(0, len(flat), CHUNK_BYTES):
        yield flat[start:start + CHUNK_BYTES]


def save(folder: str, ckpt: Checkpoint, *, keep: int) -> str:
    """Write ckpt atomically into folder and prune all but the newest `keep`."""
    path = os.path.join(folder, file_name(ckpt.step))
    write(path, ckpt)
    _prune(folder, keep)
    return path


def write(path: str, ckpt: Checkpoint, pieces: Pieces | None = None) -> str:
    """Write ckpt atomically to path (in the checkpoint format); its SHA-256. With pieces,
    each array is written from its pieces instead of ckpt.arrays (a re-cut's, never joined).
    Each chunk is hashed and written in turn, and the header, which holds the hash, last."""
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)}{TEMPORARY}")
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise errors.CheckpointError(f"cannot write checkpoint {path}: {folder} is not a folder")
    body = _body(ckpt, pieces)
    digest = hashlib.sha256(json.dumps(body).encode())
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "wb") as f, concurrent.futures.ThreadPoolExecutor(1, "checkpoint-hash") as hasher:
            f.write(_head(body, "0" * digest.digest_size * 2))
            for piece in _laid(ckpt, pieces):
                for chunk in _chunks(piece):  # hashed on another core as it is written (both free the GIL)
                    hashed = hasher.submit(digest.update, chunk)
                    f.write(chunk)
                    hashed.result()
            f.seek(0)
            f.write(_head(body, digest.hexdigest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_folder(folder)
    except OSError as exc:
        _remove_quietly(tmp)
        raise errors.CheckpointError(f"cannot write checkpoint {path}: {exc.strerror or exc}") from exc
    return digest.hexdigest()


def load(path: str, *, copy: bool = True) -> Checkpoint:
    """Read and verify one checkpoint; CorruptCheckpoint says why it cannot be trusted.
    Without copy, the arrays are views of the file's bytes, aligned (numpy copies an
    unaligned array whole before many operations): a large file's are mapped, private to
    this process, so that its pages come from the page cache instead of fresh memory."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(len(MAGIC) + LENGTH.size)
            header = LENGTH.unpack_from(head, len(MAGIC))[0] if len(head) == len(MAGIC) + LENGTH.size else 0
            start = len(head) + min(header, size)
            if not copy and size >= MAP_AT_LEAST and start % ALIGN == 0:
                blob = memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY))
            else:
                blob = _read_aligned(f, head, start, size)
    except OSError as exc:
        raise errors.CorruptCheckpoint(f"{path}: unreadable: {exc}") from exc
    return decode(blob, path, copy=copy)


def _read_aligned(f: io.BufferedReader, head: bytes, start: int, size: int) -> memoryview:
    """The whole file (its first bytes, head, already read), placed so that its arrays,
    from start, begin on a 64-byte boundary."""
    buffer = np.empty(size + ALIGN, dtype=np.uint8)
    offset = -(buffer.ctypes.data + start) % ALIGN
    blob = buffer.data[offset:offset + size]
    blob[:len(head)] = head
    read = len(head)
    while read < size and (got := f.readinto(blob[read:])):
        read += got
    return blob[:read]


def decode(blob: bytes | memoryview, source: str, *, copy: bool = True) -> Checkpoint:
    """A checkpoint from the bytes encode() made, verified; source names them in errors."""
    blob = memoryview(blob)
    header, start = _header(source, blob)
    body = {k: v for k, v in header.items() if k != "sha256"}
    try:
        names_and_sizes = [(str(n), int(s)) for n, s in header["arrays"]]
        step, layout, shard = int(header["step"]), int(header["layout"]), int(header["shard"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise errors.CorruptCheckpoint(f"{source}: unreadable header: {exc}") from exc
    payload = blob[start:]
    expected = sum(size for _, size in names_and_sizes) * DTYPE.itemsize
    if len(payload) != expected:
        raise errors.CorruptCheckpoint(f"{source}: {len(payload)} bytes of data, header declares {expected}")
    digest = hashlib.sha256(json.dumps(body).encode())
    digest.update(payload)
    if digest.hexdigest() != header.get("sha256"):
        raise errors.CorruptCheckpoint(f"{source}: checksum mismatch")
    arrays, offset = {}, 0
    for name, size in names_and_sizes:
        array = np.frombuffer(payload, dtype=DTYPE, count=size, offset=offset)
        arrays[name] = array.copy() if copy else array
        offset += size * DTYPE.itemsize
    return Checkpoint(step=step, layout=layout, shard=shard, arrays=arrays, meta=dict(header.get("meta", {})),
                      sha256=digest.hexdigest())


def read_header(path: str) -> dict[str, Any]:
    """A checkpoint's header (step, layout, shard, meta, arrays), without reading (or
    verifying) its arrays."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + LENGTH.size)
            length = LENGTH.unpack_from(head, len(MAGIC))[0] if len(head) == len(MAGIC) + LENGTH.size else 0
            blob = head + f.read(min(length, MAX_HEADER_BYTES))
    except OSError as exc:
        raise errors.CorruptCheckpoint(f"{path}: unreadable: {exc}") from exc
    return _header(path, blob)[0]


def read_meta(path: str) -> dict[str, Any]:
    """The free metadata in a checkpoint's header, without reading (or verifying) its arrays."""
    meta = read_header(path).get("meta", {})
    if not isinstance(meta, dict):
        raise errors.CorruptCheckpoint(f"{path}: unreadable header: meta is not an object")
    return meta


def _header(source: str, blob: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """The JSON header at the start of blob, and where the arrays start."""
    if bytes(blob[:len(MAGIC)]) != MAGIC or len(blob) < len(MAGIC) + LENGTH.size:
        raise errors.CorruptCheckpoint(f"{source}: not a checkpoint (bad magic)")
    (length,) = LENGTH.unpack_from(blob, len(MAGIC))
    start = len(MAGIC) + LENGTH.size
    if length > MAX_HEADER_BYTES or start + length > len(blob):
        raise errors.CorruptCheckpoint(f"{source}: truncated header")
    try:
        header = json.loads(bytes(blob[start:start + length]))
    except ValueError as exc:  # UnicodeDecodeError included
        raise errors.CorruptCheckpoint(f"{source}: unreadable header: {exc}") from exc
    if not isinstance(header, dict):
        raise errors.CorruptCheckpoint(f"{source}: unreadable header: not an object")
    return header, start + length


def step_of(path: str) -> int:
    """The step a checkpoint file's name says it holds."""
    return int(os.path.basename(path)[len("step-"):-len(SUFFIX)])


def newest_verified(folder: str, *, copy: bool = True) -> tuple[Checkpoint, str] | None:
    """The newest checkpoint in folder that verifies (without copy: its arrays are views of
    the file's bytes), and its path; a damaged one is passed over (its shard sets it aside
    when it starts)."""
    for path in list_checkpoints(folder):
        try:
            return load(path, copy=copy), path
        except errors.CorruptCheckpoint:
            continue
    return None


def list_checkpoints(folder: str) -> list[str]:
    """Checkpoint files in folder, newest first."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith("step-") and n.endswith(SUFFIX)]
    except (FileNotFoundError, NotADirectoryError):  # gone, or replaced while a write finished
        return []
    return [os.path.join(folder, n) for n in sorted(names, reverse=True)]


# The checkpoint's record of the job that wrote it (its uid on a cluster).
JOB_UID = "jobUid"
# Its record of the last command of the shard's journal it holds (journal.py).
JOURNAL_SEQ = "journalSeq"


def restore_latest(folder: str, *, layout: int, shard: int, job_uid: str | None = None,
                   accept: Callable[[Checkpoint], None] = lambda ckpt: None) -> Checkpoint | None:
    """The newest checkpoint of this shard that verifies and that accept takes, or None.

    A corrupt file, or one whose accept raised CorruptCheckpoint (a file it refers to is
    damaged or missing), is renamed to *.corrupt and the previous one tried. A valid file
    written for another layout or shard, or (job_uid given) by another job, is an error:
    continuing would train a different model on top of it, or resume another job's
    training (a deleted job of the same name left its volume), and discarding it would
    lose the user's work. A file that records no job (local mode's, or written before
    checkpoints recorded it) is this job's. Temporaries of interrupted writes are deleted
    first: they are never complete checkpoints, and only this shard, not yet serving,
    writes the folder."""
    remove_partial_writes(folder)
    for path in list_checkpoints(folder):
        try:
            ckpt = load(path)
            _check_owner(path, ckpt, layout, shard, job_uid)
            accept(ckpt)
        except errors.CorruptCheckpoint as exc:
            log.error("event=checkpoint_corrupt path=%s reason=%r action=set_aside", path, str(exc))
            os.replace(path, path + ".corrupt")
            continue
        return ckpt
    return None


def _check_owner(path: str, ckpt: Checkpoint, layout: int, shard: int, job_uid: str | None) -> None:
    if ckpt.layout != layout or ckpt.shard != shard:
        raise errors.CheckpointError(
            f"{path} belongs to shard {ckpt.shard} of layout {ckpt.layout:016x}, "
            f"not shard {shard} of layout {layout:016x}: the model or shard count changed; "
            "point the shard at another checkpoint folder")
    written_by = ckpt.meta.get(JOB_UID)
    if job_uid and written_by and written_by != job_uid:
        raise errors.CheckpointError(
            f"{path} was written by another job of this name (uid {written_by}; this job is {job_uid}): "
            "a deleted job left its checkpoint volume, and a new job does not resume another's training; "
            "delete the shards' checkpoint claims to start afresh")


def remove_partial_writes(folder: str, suffix: str = SUFFIX) -> None:
    """Delete the temporaries that writes of files named *suffix left when interrupted."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith(".") and n.endswith(suffix + TEMPORARY)]
    except FileNotFoundError:
        return
    for path in (os.path.join(folder, name) for name in names):
        if os.path.isfile(path):
            log.info("event=partial_checkpoint_removed path=%s", path)
            _remove_quietly(path)


def _as_f32(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=DTYPE).reshape(-1)


def _prune(folder: str, keep: int) -> None:
    for old in list_checkpoints(folder)[keep:]:
        _remove_quietly(old)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def fsync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
