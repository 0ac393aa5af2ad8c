"""Checkpoints of embedding rows: whole while small, a base and deltas beyond; atomic,
self-checking, pruned without losing what a restore needs (restorable after SIGKILL:
chaos/test_rowcheckpoint_kill.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from distbelief.runtime import errors
from distbelief.runtime.params.rows import rowcheckpoint
from distbelief.runtime.params.rows.sparse import SparseRows
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.core import Shard
from support.rowshards import DIM, KEEP, make_shard, named_files, push, row_files, snapshot, step, table


def test_a_small_table_is_written_whole_and_a_large_one_as_a_base_then_deltas_of_changed_rows(tmp_path: Path) -> None:
    shard = make_shard(tmp_path)
    step(shard, np.arange(50))
    assert row_files(tmp_path) == set()  # 50 rows: whole, inside the shard's checkpoint
    assert "sparse.values" in checkpoint.load(checkpoint.list_checkpoints(str(tmp_path))[0]).arrays
    step(shard, np.arange(50, 400))
    newest = checkpoint.load(checkpoint.list_checkpoints(str(tmp_path))[0])
    assert "sparse.values" not in newest.arrays
    (base,) = newest.meta[rowcheckpoint.CHAIN]
    assert base["file"].startswith("base-") and base["rows"] == 400
    step(shard, np.array([3, 77, 390]))
    (_, delta) = checkpoint.load(checkpoint.list_checkpoints(str(tmp_path))[0]).meta[rowcheckpoint.CHAIN]
    assert delta["file"].startswith("delta-") and delta["rows"] == 3
    part = checkpoint.load(str(tmp_path / rowcheckpoint.FOLDER / delta["file"]))
    np.testing.assert_array_equal(np.sort(rowcheckpoint.keys_from_parts(part.arrays["keys"])), [3, 77, 390])
    step(shard, np.array([], dtype=np.int64))  # nothing pushed: no file, the chain stands
    assert len(checkpoint.load(checkpoint.list_checkpoints(str(tmp_path))[0]).meta[rowcheckpoint.CHAIN]) == 2
    restored = make_shard(tmp_path)
    assert restored.step == 4 and snapshot(table(restored)) == snapshot(table(shard))


def test_compaction_and_pruning_keep_every_file_a_kept_checkpoint_names(tmp_path: Path) -> None:
    shard = make_shard(tmp_path)
    step(shard, np.arange(1000))
    states = {shard.step: snapshot(table(shard))}
    bases = set()
    rng = np.random.default_rng(0)
    for _ in range(3 * rowcheckpoint.MAX_DELTAS):
        step(shard, np.unique(rng.integers(0, 1100, 30)))  # a few updates, a few new rows
        states[shard.step] = snapshot(table(shard))
        chain = shard.plugin(SparseRows).saved.chain
        bases.add(chain[0]["file"])
        assert len(chain) <= rowcheckpoint.MAX_DELTAS + 1
        assert named_files(tmp_path) <= row_files(tmp_path)  # nothing a kept checkpoint names is gone
        # and little else stays: at most the files of the checkpoint pruned last
        assert len(row_files(tmp_path) - named_files(tmp_path)) <= rowcheckpoint.MAX_DELTAS + 1
    assert len(bases) >= 3  # compacted into new bases along the way
    kept = checkpoint.list_checkpoints(str(tmp_path))
    assert len(kept) == KEEP
    for path in kept:  # each kept checkpoint restores the table of its own step
        ckpt = checkpoint.load(path)
        other = make_shard(tmp_path)
        other.load(ckpt)
        assert snapshot(table(other)) == states[ckpt.step]


def test_rows_dropped_by_expiry_stay_dropped_after_a_restore(tmp_path: Path) -> None:
    shard = make_shard(tmp_path, expire_after=10.0)
    step(shard, np.arange(1000), now=1000.0)
    step(shard, np.arange(200), now=1020.0)  # a delta, too small to call for a new base
    shard.plugin(SparseRows)._expire(now=1025.0)  # what a push after the expiry interval runs
    assert table(shard).n == 200
    step(shard, np.arange(1000, 1010), now=1025.0)
    (base,) = shard.plugin(SparseRows).saved.chain  # a delta cannot say which rows went
    assert base["file"].startswith("base-") and base["rows"] == 210
    restored = make_shard(tmp_path, expire_after=10.0)
    assert sorted(table(restored).keys[: table(restored).n]) == [*range(200), *range(1000, 1010)]


def _damage(path: Path, how: str, other: Path) -> None:
    if how == "flipped":
        blob = bytearray(path.read_bytes())
        blob[-5] ^= 0xFF
        path.write_bytes(bytes(blob))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-40])
    elif how == "missing":
        path.unlink()
    else:  # another valid row file under its name
        path.write_bytes(other.read_bytes())


@pytest.mark.parametrize("how", ["flipped", "truncated", "missing", "replaced"])
def test_a_damaged_delta_is_reported_and_the_previous_checkpoint_restored(tmp_path: Path, how: str,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    shard = make_shard(tmp_path)
    step(shard, np.arange(300))
    step(shard, np.arange(10))
    good = snapshot(table(shard))
    step(shard, np.arange(5, 20))
    chain = shard.plugin(SparseRows).saved.chain
    rows = tmp_path / rowcheckpoint.FOLDER
    _damage(rows / chain[-1]["file"], how, rows / chain[-2]["file"])
    with caplog.at_level(logging.ERROR):
        restored = make_shard(tmp_path)
    assert restored.step == 2 and snapshot(table(restored)) == good
    assert "the rows of the checkpoint of step 3 cannot be restored" in caplog.text
    assert (tmp_path / (checkpoint.file_name(3) + ".corrupt")).exists()  # set aside, not deleted
    if how != "missing":
        assert (rows / (chain[-1]["file"] + ".corrupt")).exists()
    step(restored, np.arange(30, 40))  # training goes on from the good state, on its chain
    again = make_shard(tmp_path)
    assert again.step == 3 and snapshot(table(again)) == snapshot(table(restored))


def _full_disk(*args: object, **kwargs: object) -> str:
    raise errors.CheckpointError("cannot write checkpoint: No space left on device")


def test_a_checkpoint_that_fails_after_its_delta_keeps_the_delta_in_the_chain(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    shard = make_shard(tmp_path)
    step(shard, np.arange(300))
    real_save = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", _full_disk)
    step(shard, np.arange(10))  # the delta is written, the shard's checkpoint is not
    monkeypatch.setattr(checkpoint, "save", real_save)
    step(shard, np.arange(100, 105))
    restored = make_shard(tmp_path)
    assert restored.step == 3 and snapshot(table(restored)) == snapshot(table(shard))


def test_a_row_file_that_cannot_be_written_is_a_failed_checkpoint_and_training_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shard = make_shard(tmp_path)
    step(shard, np.arange(300))
    real_write = checkpoint.write
    monkeypatch.setattr(checkpoint, "write", _full_disk)
    step(shard, np.arange(10))  # neither the delta nor the shard's checkpoint is written
    assert shard.saves.failures == 1
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [1]
    monkeypatch.setattr(checkpoint, "write", real_write)
    step(shard, np.arange(100, 105))  # the next delta holds the rows the failed one would have
    assert shard.saves.failures == 0
    restored = make_shard(tmp_path)
    assert restored.step == 3 and snapshot(table(restored)) == snapshot(table(shard))


def test_non_finite_rows_go_back_past_a_checkpoint_whose_row_files_are_damaged(tmp_path: Path) -> None:
    shard = make_shard(tmp_path)
    step(shard, np.arange(300))
    good = snapshot(table(shard))
    step(shard, np.arange(10))
    rows = tmp_path / rowcheckpoint.FOLDER
    (rows / shard.plugin(SparseRows).saved.chain[-1]["file"]).unlink()
    push(shard, np.arange(20, 25))
    t = table(shard)
    t.values[np.flatnonzero(t.dirty[: t.n])] = np.nan  # an update overflowed
    shard.step += 1
    shard.checkpoint_now()
    assert shard.step == 1 and snapshot(table(shard)) == good
    assert (tmp_path / (checkpoint.file_name(2) + ".corrupt")).exists()


def test_a_crash_between_the_rows_and_the_checkpoint_loses_nothing_saved(tmp_path: Path) -> None:
    shard = make_shard(tmp_path)
    step(shard, np.arange(300))
    step(shard, np.arange(10))
    good = snapshot(table(shard))
    push(shard, np.arange(20, 30))
    shard.step += 1
    shard.plugin(SparseRows).checkpoint_state()  # its delta lands; then the process dies
    orphan = shard.plugin(SparseRows).saved.chain[-1]["file"]
    rows = tmp_path / rowcheckpoint.FOLDER
    (rows / f".delta-000000000004-0000.rows{checkpoint.TEMPORARY}").write_bytes(checkpoint.MAGIC + b"\0" * 50)
    restored = make_shard(tmp_path)
    assert restored.step == 2 and snapshot(table(restored)) == good
    assert not any(name.endswith(checkpoint.TEMPORARY) for name in row_files(tmp_path))
    step(restored, np.arange(40, 45))
    assert orphan not in row_files(tmp_path)  # named by no checkpoint: pruned
    assert snapshot(table(make_shard(tmp_path))) == snapshot(table(restored))


@pytest.mark.parametrize("rows", [40, 400])  # whole in the checkpoint, and as a base then deltas
def test_the_optional_row_arrays_survive_a_restart(tmp_path: Path, rows: int) -> None:
    options = {"wide": 1, "l2": 1e-3, "wide_l2": 3e-5, "embed_after": 3}

    def make(folder: Path) -> Shard:  # rows of DIM embedding values and one wide, and their counters
        return make_shard(folder, dim=DIM + 1, row_bytes=(DIM + 9) * 4, **options)

    first = make(tmp_path)
    keys = np.arange(1, rows + 1, dtype=np.int64) * 7919
    t = table(first)
    for at, pushed in ((10, keys), (25, keys[: rows // 2])):  # the second checkpoint: a delta of half the rows
        t.update(pushed, np.ones((pushed.size, DIM + 1), np.float32), 1000.0, np.full(pushed.size, 2), step=at)
        first.step = at
        first.checkpoint_now()
    saved = {name: getattr(t, name)[: t.n].copy() for name in t.row_arrays if name != "dirty"}
    second = make(tmp_path)
    again = table(second)
    order = again.lookup(saved["keys"])
    for name, values in saved.items():
        np.testing.assert_array_equal(getattr(again, name)[order], values, err_msg=name)


def test_rows_saved_without_a_wide_part_are_refused_by_a_job_with_one(tmp_path: Path) -> None:
    first = make_shard(tmp_path)
    step(first, np.arange(5, dtype=np.int64))
    with pytest.raises(errors.ConfigError, match=r"hold embedding rows of 4 embedding values \(no wide part\), "
                                                 r"and this job's rows are 3 embedding values and 1 wide"):
        make_shard(tmp_path, wide=1)
