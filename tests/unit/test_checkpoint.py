"""Unit tests of distbelief.runtime.shard.checkpoint: round trip, pruning, atomic writes, and
what restore does with corrupt, foreign and unwritable checkpoints."""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from distbelief.runtime import errors
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.checkpoint import Checkpoint

LAYOUT = 0xFEDCBA9876543210  # uses all 64 bits
SHARD = 3


def make(step: int, size: int = 1000, layout: int = LAYOUT, shard: int = SHARD, meta=None) -> Checkpoint:
    rng = np.random.default_rng(step)
    return Checkpoint(step=step, layout=layout, shard=shard,
                      arrays={"params": rng.standard_normal(size).astype(np.float32),
                              "adagrad_accumulator": rng.random(size).astype(np.float32)},
                      meta={"loss": 0.5, "examples": step * 10} if meta is None else meta)


def assert_same(actual: Checkpoint, expected: Checkpoint) -> None:
    assert (actual.step, actual.layout, actual.shard) == (expected.step, expected.layout, expected.shard)
    assert actual.meta == expected.meta
    assert list(actual.arrays) == list(expected.arrays)
    for name, array in expected.arrays.items():
        assert actual.arrays[name].dtype == np.float32
        np.testing.assert_array_equal(actual.arrays[name], array)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def header_span(blob: bytes) -> tuple[int, int]:
    start = len(checkpoint.MAGIC) + checkpoint.LENGTH.size
    (length,) = checkpoint.LENGTH.unpack_from(blob, len(checkpoint.MAGIC))
    return start, start + length


# --- round trip, naming, pruning ---------------------------------------------------------

def test_round_trip(tmp_path):
    ckpt = make(42, meta={"loss": 0.25, "examples": 12345, "nested": {"curve": [1, 2.5]}, "name": "ünï"})
    path = checkpoint.save(str(tmp_path), ckpt, keep=3)
    assert path == str(tmp_path / "step-000000000042.ckpt")
    assert_same(checkpoint.load(path), ckpt)
    assert_same(checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD), ckpt)


def test_meta_that_json_normalises_still_verifies(tmp_path):
    """The checksum covers the header as JSON: meta that JSON rewrites (tuples, int keys,
    floats such as nan) must not make a good checkpoint look corrupt."""
    ckpt = make(3, meta={1: (2, 3), "lr": 0.1, "nan": float("nan"), "none": None, "flag": True})
    loaded = checkpoint.load(checkpoint.save(str(tmp_path), ckpt, keep=1))
    assert loaded.meta["1"] == [2, 3] and loaded.meta["lr"] == 0.1 and np.isnan(loaded.meta["nan"])
    assert loaded.meta["none"] is None and loaded.meta["flag"] is True


def test_round_trip_of_empty_and_odd_arrays(tmp_path):
    ckpt = Checkpoint(step=0, layout=0, shard=0,
                      arrays={"empty": np.zeros(0, dtype=np.float32), "one": np.array([7.5], dtype=np.float32),
                              "f64": np.array([1.5, -2.25]), "strided": np.arange(10, dtype=np.float32)[::3]})
    loaded = checkpoint.load(checkpoint.save(str(tmp_path), ckpt, keep=1))
    assert loaded.meta == {}
    assert loaded.arrays["empty"].shape == (0,)
    np.testing.assert_array_equal(loaded.arrays["one"], [7.5])
    np.testing.assert_array_equal(loaded.arrays["f64"], np.array([1.5, -2.25], dtype=np.float32))
    assert loaded.arrays["f64"].dtype == np.float32  # stored as float32
    np.testing.assert_array_equal(loaded.arrays["strided"], [0, 3, 6, 9])


def test_loaded_arrays_are_writable_copies(tmp_path):
    loaded = checkpoint.load(checkpoint.save(str(tmp_path), make(1), keep=1))
    loaded.arrays["params"][0] = 99.0  # a shard trains on them in place
    assert checkpoint.load(str(tmp_path / checkpoint.file_name(1))).arrays["params"][0] != 99.0


BIG = checkpoint.MAP_AT_LEAST // 4  # float32 values: a file large enough to be mapped


def test_the_arrays_start_aligned_in_the_file(tmp_path):
    """A file's arrays begin on a 64-byte boundary (the header is padded), so that a
    reader that maps the file gets aligned arrays; the padding is outside the checksum."""
    for meta in ({}, {"a": 1}, {"ab": "c" * 100}):
        blob = Path(checkpoint.save(str(tmp_path), make(1, meta=meta), keep=1)).read_bytes()
        assert header_span(blob)[1] % checkpoint.ALIGN == 0, meta


@pytest.mark.parametrize("size", [10, BIG])
def test_a_view_load_of_a_large_file_maps_it_privately(tmp_path, size):
    """Without copy, a large file is mapped (its pages from the page cache, not fresh
    memory): aligned, verified, and writable without the writes reaching the file."""
    ckpt = make(7, size=size)
    path = checkpoint.save(str(tmp_path), ckpt, keep=1)
    loaded = checkpoint.load(path, copy=False)
    assert_same(loaded, ckpt)
    params = loaded.arrays["params"]
    assert params.ctypes.data % checkpoint.ALIGN == 0
    assert isinstance(params.base, memoryview) and isinstance(params.base.obj, mmap.mmap) is (size == BIG)
    params[0] = 99.0
    assert_same(checkpoint.load(path), ckpt)


def test_a_mapped_file_that_is_corrupt_says_why(tmp_path):
    path = Path(checkpoint.save(str(tmp_path), make(2, size=BIG), keep=1))
    path.write_bytes(flip_data_byte(path.read_bytes()))
    with pytest.raises(errors.CorruptCheckpoint, match="checksum"):
        checkpoint.load(str(path), copy=False)


def test_a_file_written_before_the_header_was_padded_still_loads(tmp_path):
    """Files whose arrays start anywhere (no padding) load, mapped or not: read, aligned."""
    ckpt = make(3, size=BIG)
    path = Path(checkpoint.save(str(tmp_path), ckpt, keep=1))
    blob = path.read_bytes()
    start, end = header_span(blob)
    header = blob[start:end].rstrip(b" ") + b" "  # one byte of padding off 64: unaligned
    if (start + len(header)) % checkpoint.ALIGN == 0:
        header += b" "
    path.write_bytes(blob[:len(checkpoint.MAGIC)] + checkpoint.LENGTH.pack(len(header)) + header + blob[end:])
    assert_same(checkpoint.load(str(path)), ckpt)
    viewed = checkpoint.load(str(path), copy=False)
    assert_same(viewed, ckpt)
    assert viewed.arrays["params"].ctypes.data % checkpoint.ALIGN == 0


def test_save_creates_a_missing_folder(tmp_path):
    folder = tmp_path / "a" / "b"
    checkpoint.save(str(folder), make(5), keep=2)
    assert [p.name for p in folder.iterdir()] == ["step-000000000005.ckpt"]


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_prunes_to_the_newest(tmp_path, keep):
    for step in (9, 10, 100, 1, 99):  # out of order, crossing digit counts
        checkpoint.save(str(tmp_path), make(step, size=10), keep=keep)
    newest = [100, 99, 10, 9, 1]
    kept = checkpoint.list_checkpoints(str(tmp_path))
    # pruning runs after every save, so what survives depends on the order of saves
    assert len(kept) == min(keep, 5)
    assert kept[0] == str(tmp_path / checkpoint.file_name(100))
    assert kept == sorted(kept, reverse=True)
    assert all(int(Path(p).name[5:17]) in newest for p in kept)


def test_keep_keeps_exactly_the_newest_n(tmp_path):
    for step in range(1, 7):
        checkpoint.save(str(tmp_path), make(step, size=10), keep=3)
    assert checkpoint.list_checkpoints(str(tmp_path)) == [
        str(tmp_path / checkpoint.file_name(s)) for s in (6, 5, 4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.file_name(s) for s in (4, 5, 6)]
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD).step == 6


def test_prune_leaves_other_files_alone(tmp_path):
    (tmp_path / "history.jsonl").write_text("{}\n")
    (tmp_path / "step-000000000001.ckpt.corrupt").write_bytes(b"bad")
    for step in range(2, 5):
        checkpoint.save(str(tmp_path), make(step, size=10), keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "history.jsonl", "step-000000000001.ckpt.corrupt", "step-000000000004.ckpt"]


def test_list_checkpoints_of_a_missing_folder_is_empty(tmp_path):
    assert checkpoint.list_checkpoints(str(tmp_path / "nope")) == []
    assert checkpoint.restore_latest(str(tmp_path / "nope"), layout=LAYOUT, shard=SHARD) is None
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD) is None


def test_resaving_a_step_replaces_it(tmp_path):
    checkpoint.save(str(tmp_path), make(7, meta={"v": 1}), keep=5)
    checkpoint.save(str(tmp_path), make(7, meta={"v": 2}), keep=5)
    assert len(checkpoint.list_checkpoints(str(tmp_path))) == 1
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD).meta == {"v": 2}


# --- atomic writes -----------------------------------------------------------------------

def test_save_leaves_no_temporary_file(tmp_path):
    for step in range(3):
        checkpoint.save(str(tmp_path), make(step), keep=5)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [checkpoint.file_name(s) for s in range(3)]


def test_failed_write_leaves_no_temporary_and_the_old_set_intact(tmp_path, monkeypatch):
    for step in (1, 2):
        checkpoint.save(str(tmp_path), make(step), keep=2)
    before = snapshot(tmp_path)

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(errors.CheckpointError, match="step-000000000003.ckpt.*No space left on device"):
        checkpoint.save(str(tmp_path), make(3), keep=2)
    monkeypatch.undo()
    assert snapshot(tmp_path) == before  # nothing new, nothing pruned, no temporary
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD).step == 2


def test_restore_removes_the_temporaries_of_interrupted_writes(tmp_path):
    for step in (1, 2):
        checkpoint.save(str(tmp_path), make(step), keep=5)
    for torn in (3, 7):  # half-written, as a crash mid-write leaves them
        (tmp_path / f".{checkpoint.file_name(torn)}.tmp").write_bytes(checkpoint.MAGIC + b"\0" * 100)
    (tmp_path / "notes.tmp").write_text("not ours")
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD).step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp", checkpoint.file_name(1),
                                                          checkpoint.file_name(2)]


def test_blocked_temporary_path_is_a_checkpoint_error(tmp_path):
    """A folder where the new file cannot be created (here its temporary name is taken by a
    directory) fails with CheckpointError, and the earlier checkpoints stay."""
    for step in (1, 2):
        checkpoint.save(str(tmp_path), make(step), keep=2)
    blocker = tmp_path / f".{checkpoint.file_name(3)}.tmp"
    blocker.mkdir()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(errors.CheckpointError, match="cannot write checkpoint"):
        checkpoint.save(str(tmp_path), make(3), keep=2)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD).step == 2


@pytest.mark.parametrize("where", ["is-a-file", "under-a-file", "proc"])
def test_unwritable_folder_is_a_checkpoint_error(tmp_path, where):
    good = tmp_path / "good"
    for step in (1, 2):
        checkpoint.save(str(good), make(step), keep=2)
    before = snapshot(good)
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"a regular file")
    folder = {"is-a-file": str(blocker), "under-a-file": str(blocker / "ckpts"),
              "proc": "/proc/distbelief-test-no-such-dir"}[where]
    with pytest.raises(errors.CheckpointError) as info:
        checkpoint.save(folder, make(3), keep=2)
    assert folder in str(info.value)
    assert not isinstance(info.value, errors.CorruptCheckpoint)
    assert blocker.read_bytes() == b"a regular file"
    assert snapshot(good) == before
    assert checkpoint.restore_latest(str(good), layout=LAYOUT, shard=SHARD).step == 2


# --- corrupt files -----------------------------------------------------------------------

def flip_data_byte(blob: bytes) -> bytes:
    i = len(blob) - 17
    return blob[:i] + bytes([blob[i] ^ 0x01]) + blob[i + 1:]


def flip_first_data_byte(blob: bytes) -> bytes:
    i = header_span(blob)[1]
    return blob[:i] + bytes([blob[i] ^ 0x80]) + blob[i + 1:]


def truncate_data(blob: bytes) -> bytes:
    return blob[:-10]


def truncate_header(blob: bytes) -> bytes:
    return blob[:header_span(blob)[0] + 5]


def truncate_to_magic(blob: bytes) -> bytes:
    return blob[:len(checkpoint.MAGIC) + 3]


def empty(blob: bytes) -> bytes:
    return b""


def extra_data(blob: bytes) -> bytes:
    return blob + b"\0\0\0\0"


def bad_magic(blob: bytes) -> bytes:
    return b"DBCKPT99" + blob[len(checkpoint.MAGIC):]


def huge_header_length(blob: bytes) -> bytes:
    return checkpoint.MAGIC + checkpoint.LENGTH.pack(2**63) + blob[header_span(blob)[0]:]


def garbage_header(blob: bytes) -> bytes:
    start, stop = header_span(blob)
    return blob[:start] + bytes((i * 37 + 131) % 256 for i in range(stop - start)) + blob[stop:]


def non_json_header(blob: bytes) -> bytes:
    start, stop = header_span(blob)
    return blob[:start] + b"x" * (stop - start) + blob[stop:]


def header_without_keys(blob: bytes) -> bytes:
    start, stop = header_span(blob)
    return blob[:start] + b"{}".ljust(stop - start) + blob[stop:]


def header_not_an_object(blob: bytes) -> bytes:
    start, stop = header_span(blob)
    return blob[:start] + b"[1, 2]".ljust(stop - start) + blob[stop:]


def header_with_bad_arrays(blob: bytes) -> bytes:
    start, stop = header_span(blob)
    header = json.loads(blob[start:stop])
    header["arrays"] = [["params"]]
    text = json.dumps(header).encode().ljust(stop - start)
    assert len(text) == stop - start
    return blob[:start] + text + blob[stop:]


def header_lying_about_sizes(blob: bytes) -> bytes:
    start, stop = header_span(blob)
    header = json.loads(blob[start:stop])
    header["arrays"][0][1] += 1
    header["arrays"][1][1] -= 1
    text = json.dumps(header).encode()
    return blob[:len(checkpoint.MAGIC)] + checkpoint.LENGTH.pack(len(text)) + text + blob[stop:]


def header_field_changer(key: str):
    """Change one digit of a number in the header: same length, still valid JSON."""
    def change(blob: bytes) -> bytes:
        start, stop = header_span(blob)
        header = blob[start:stop]
        at = header.index(f'"{key}": '.encode()) + len(key) + 4
        digit = header[at:at + 1]
        assert digit.isdigit(), header
        changed = b"7" if digit != b"7" else b"8"
        return blob[:start + at] + changed + blob[start + at + 1:]
    change.__name__ = f"change_{key}"
    return change


CORRUPTIONS = {
    "flip-data-byte": (flip_data_byte, "checksum"),
    "flip-first-data-byte": (flip_first_data_byte, "checksum"),
    "truncate-data": (truncate_data, "bytes of data"),
    "append-data": (extra_data, "bytes of data"),
    "truncate-header": (truncate_header, "truncated header"),
    "truncate-to-magic": (truncate_to_magic, "bad magic"),
    "empty-file": (empty, "bad magic"),
    "bad-magic": (bad_magic, "bad magic"),
    "huge-header-length": (huge_header_length, "truncated header"),
    "garbage-header": (garbage_header, "unreadable header"),
    "non-json-header": (non_json_header, "unreadable header"),
    "header-without-keys": (header_without_keys, "unreadable header"),
    "header-not-an-object": (header_not_an_object, "unreadable header"),
    "header-with-bad-arrays": (header_with_bad_arrays, "unreadable header"),
    "header-lying-about-sizes": (header_lying_about_sizes, "checksum"),
    # a flipped digit in the header must not pass for a checkpoint of another step,
    # layout or shard: the checksum covers the header too
    "header-step-digit": (header_field_changer("step"), "checksum"),
    "header-layout-digit": (header_field_changer("layout"), "checksum"),
    "header-shard-digit": (header_field_changer("shard"), "checksum"),
    "header-meta-digit": (header_field_changer("examples"), "checksum"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_load_of_a_corrupt_file_says_why(tmp_path, corruption):
    corrupt, reason = CORRUPTIONS[corruption]
    path = Path(checkpoint.save(str(tmp_path), make(2), keep=2))
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(errors.CorruptCheckpoint, match=reason) as info:
        checkpoint.load(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_corrupt_newest_falls_back_to_the_previous_and_is_set_aside(tmp_path, corruption):
    corrupt, _ = CORRUPTIONS[corruption]
    good = make(1)
    checkpoint.save(str(tmp_path), good, keep=3)
    newest = Path(checkpoint.save(str(tmp_path), make(2), keep=3))
    bad_bytes = corrupt(newest.read_bytes())
    newest.write_bytes(bad_bytes)
    restored = checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD)
    assert_same(restored, good)
    assert not newest.exists()
    aside = Path(str(newest) + ".corrupt")
    assert aside.read_bytes() == bad_bytes  # renamed, not deleted
    assert checkpoint.list_checkpoints(str(tmp_path)) == [str(tmp_path / checkpoint.file_name(1))]
    # restoring again finds the same good one, and the set-aside file is not touched
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD).step == 1
    assert aside.read_bytes() == bad_bytes


def test_all_corrupt_gives_none_and_keeps_every_file(tmp_path):
    for step, corrupt in zip((1, 2, 3), (flip_data_byte, bad_magic, truncate_data)):
        path = Path(checkpoint.save(str(tmp_path), make(step), keep=3))
        path.write_bytes(corrupt(path.read_bytes()))
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        checkpoint.file_name(s) + ".corrupt" for s in (1, 2, 3)]


def test_corrupt_files_do_not_count_against_keep(tmp_path):
    path = Path(checkpoint.save(str(tmp_path), make(1), keep=2))
    path.write_bytes(truncate_data(path.read_bytes()))
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD) is None
    checkpoint.save(str(tmp_path), make(2), keep=1)
    checkpoint.save(str(tmp_path), make(3), keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        checkpoint.file_name(1) + ".corrupt", checkpoint.file_name(3)]


# --- checkpoints of another layout or shard ----------------------------------------------

@pytest.mark.parametrize("layout, shard", [(LAYOUT ^ 1, SHARD), (LAYOUT, SHARD + 1), (1, 0)])
def test_checkpoint_of_another_layout_or_shard_is_an_error(tmp_path, layout, shard):
    checkpoint.save(str(tmp_path), make(1), keep=3)
    path = checkpoint.save(str(tmp_path), make(2, layout=layout, shard=shard), keep=3)
    before = snapshot(tmp_path)
    with pytest.raises(errors.CheckpointError) as info:
        checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD)
    assert not isinstance(info.value, errors.CorruptCheckpoint)
    message = str(info.value)
    assert path in message
    assert f"shard {shard} of layout {layout:016x}" in message
    assert f"not shard {SHARD} of layout {LAYOUT:016x}" in message
    assert "another checkpoint folder" in message
    assert snapshot(tmp_path) == before  # the user's work is neither renamed nor deleted


def test_a_checkpoint_of_another_job_of_the_same_name_is_an_error(tmp_path):
    """On a cluster a job records its uid in its checkpoints: a new job of the same name that
    meets a deleted job's volume refuses it (exit code 2, InvalidConfig) and keeps it."""
    path = checkpoint.save(str(tmp_path), make(2, meta={checkpoint.JOB_UID: "old-uid"}), keep=3)
    before = snapshot(tmp_path)
    with pytest.raises(errors.CheckpointError) as info:
        checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD, job_uid="new-uid")
    assert path in str(info.value) and "uid old-uid" in str(info.value) and "this job is new-uid" in str(info.value)
    assert snapshot(tmp_path) == before
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD, job_uid="old-uid").step == 2
    # Local mode records no job, and checkpoints written before the record are the job's own.
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD).step == 2
    checkpoint.save(str(tmp_path), make(3), keep=3)
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD, job_uid="new-uid").step == 3


def test_a_folder_replaced_by_a_file_right_after_a_write_lists_no_checkpoints(tmp_path):
    """The folder can be moved away between a checkpoint's rename and its pruning (an
    operator's mistake, a volume going away): pruning must not take the shard down."""
    target = tmp_path / "file"
    target.write_text("not a folder")
    assert checkpoint.list_checkpoints(str(target)) == []
    checkpoint._prune(str(target), keep=1)  # nothing to prune, and no error


def test_a_checkpoint_its_loader_finds_corrupt_is_set_aside_and_the_previous_one_taken(tmp_path):
    """accept stands for the shard's plugins: one may find a file the checkpoint names damaged."""
    for step in (1, 2):
        checkpoint.save(str(tmp_path), make(step, meta={"rows": f"rows-{step}"}), keep=3)
    taken = []

    def accept(ckpt: Checkpoint) -> None:
        if ckpt.meta["rows"] == "rows-2":
            raise errors.CorruptCheckpoint("rows-2: checksum mismatch")
        taken.append(ckpt.step)
    assert checkpoint.restore_latest(str(tmp_path), layout=LAYOUT, shard=SHARD, accept=accept).step == 1
    assert taken == [1]
    assert (tmp_path / (checkpoint.file_name(2) + ".corrupt")).exists()


def test_read_meta_reads_the_header_only_and_names_a_bad_one(tmp_path):
    path = Path(checkpoint.save(str(tmp_path), make(4, meta={"chain": ["a"]}), keep=3))
    blob = path.read_bytes()
    path.write_bytes(blob[:-8])  # damaged data: the header alone still reads
    assert checkpoint.read_meta(str(path)) == {"chain": ["a"]}
    path.write_bytes(blob[:20])
    with pytest.raises(errors.CorruptCheckpoint, match="truncated header"):
        checkpoint.read_meta(str(path))
    assert checkpoint.write(str(path), make(4)) == checkpoint.load(str(path)).sha256
