"""params/rows/rowrecut.py: a job with embedding rows re-cut for another shard count. Every
row moves whole to the shard its key hashes to, with all its state, whether its shard wrote
it whole or as a base and deltas; shards restored from the new checkpoints hold the same
rows bit for bit, and cutting back gives the original tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distbelief.runtime import errors
from distbelief.runtime.params.rows import rowcheckpoint
from distbelief.runtime.params.rows.rowrecut import recut
from distbelief.runtime.shard import checkpoint
from distbelief.runtime.shard.core import Shard
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.rowkeys import owner_of
from support.rowshards import DIM, make_shard, row_files, table

SHAPES = [("w", (12,))]
# every optional per-row state, and admission counters
OPTIONS = {"wide": 1, "l2": 0.01, "embed_after": 2, "admit_after": 2}


def trained(folder: Path, shards: int) -> list[Shard]:
    """Shards of a job of `shards` pushed to over a few steps, each only its own keys (some
    twice in a push, so counted and admitted), shard 0 a step ahead; one checkpoint a step."""
    layout = Layout.of(SHAPES, shards)
    made = [make_shard(folder / f"old-{s}", index=s, layout=layout, **OPTIONS) for s in range(shards)]
    rng = np.random.default_rng(3)
    for number in range(6):
        keys = np.unique(rng.integers(0, 900 if number else 300, 200))
        for shard in made[: shards if number < 5 else 1]:
            mine = keys[owner_of(keys, shards) == shard.index]
            grads = np.cos(mine[:, None] + number + np.arange(DIM)).astype(np.float32)
            table(shard).update(mine, grads, 1000.0 + number, occurrences=1 + mine % 2, step=shard.step)
            shard.step += 1
            shard.checkpoint_now()
    return made


def rows(shard: Shard) -> dict[int, tuple]:
    """Each row's whole state; lazy L2's as the steps since the row's last push."""
    t = table(shard)
    return {int(k): (t.values[i].tobytes(), float(t.accumulators[i]), float(t.wide_accumulators[i]),
                     int(t.occurrences[i]), int(t.touched[i]), shard.step - int(t.stepped[i]))
            for i, k in enumerate(t.keys[: t.n])}


def resharded(shards: list[Shard], folder: Path, count: int) -> list[Shard]:
    """The shards restored from their newest checkpoints re-cut for `count` shards."""
    before, after = shards[0].layout, Layout.of(SHAPES, count)
    folders = [s.settings.checkpoint_dir for s in shards]
    old = [checkpoint.load(checkpoint.list_checkpoints(f)[0]) for f in folders]
    for new in recut(old, folders, before, after):
        checkpoint.write(str(folder / f"new-{new.header.shard}" / checkpoint.file_name(new.header.step)),
                         new.header, new.pieces)
    return [make_shard(folder / f"new-{s}", index=s, layout=after, **OPTIONS) for s in range(count)]


def union(shards: list[Shard]) -> dict[int, tuple]:
    return {key: row for shard in shards for key, row in rows(shard).items()}


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2), (2, 1)])
def test_rows_move_whole_to_their_new_owners_and_cutting_back_gives_the_original_tables(
        tmp_path: Path, before: int, after: int) -> None:
    old = trained(tmp_path, before)
    assert any(row_files(Path(s.settings.checkpoint_dir)) for s in old)  # a base and deltas among them
    new = resharded(old, tmp_path / "there", after)
    assert {s.step for s in new} == {old[0].step}
    assert union(new) == union(old) and len(union(new)) > 200
    for shard in new:
        keys = table(shard).keys[: table(shard).n]
        assert (owner_of(keys, after) == shard.index).all()
    counts = sum(table(s).counts.astype(np.int64) for s in old)
    assert all((table(s).counts == counts).all() for s in new)  # no key's admission count falls
    back = resharded(new, tmp_path / "back", before)
    for mine, theirs in zip(back, old):
        assert rows(mine) == rows(theirs)  # each original shard's rows, and no other


def test_a_damaged_row_file_is_refused_naming_its_shard(tmp_path: Path) -> None:
    old = trained(tmp_path, 2)
    damaged = next(s for s in old if row_files(Path(s.settings.checkpoint_dir)))
    folder = Path(damaged.settings.checkpoint_dir) / rowcheckpoint.FOLDER
    newest = checkpoint.load(checkpoint.list_checkpoints(damaged.settings.checkpoint_dir)[0])
    (folder / newest.meta[rowcheckpoint.CHAIN][-1]["file"]).write_bytes(b"not rows")
    with pytest.raises(errors.ReshardError, match=f"shard {damaged.index}'s rows in .*cannot be restored"):
        resharded(old, tmp_path / "there", 3)


def test_rows_of_another_shape_on_one_shard_are_refused() -> None:
    layout = Layout.of(SHAPES, 2)
    old = [checkpoint.Checkpoint(step=5, layout=layout.hash, shard=s, arrays={}, meta={"sparseDim": 4 + s})
           for s in range(2)]
    with pytest.raises(errors.ReshardError, match="differ in shape"):
        recut(old, ["a", "b"], layout, Layout.of(SHAPES, 3))


def test_shards_whose_rows_carry_different_state_are_refused_naming_each(tmp_path: Path) -> None:
    """A job whose embeddings gained lazy L2 between two shards' checkpoints."""
    layout = Layout.of(SHAPES, 2)
    plain = {**OPTIONS, "l2": 0.0}
    shards = [make_shard(tmp_path / f"old-{s}", index=s, layout=layout, **(OPTIONS if s else plain)) for s in range(2)]
    for shard in shards:
        keys = np.arange(40)[owner_of(np.arange(40), 2) == shard.index]
        table(shard).update(keys, np.ones((keys.size, DIM), np.float32), 1000.0, occurrences=np.full(keys.size, 2),
                            step=shard.step)
        shard.step += 1
        shard.checkpoint_now()
    with pytest.raises(errors.ReshardError, match="shard 0: occurrences, wide_accumulators, 1048576 admission counters; "
                                                  "shard 1: occurrences, stepped, wide_accumulators"):
        resharded(shards, tmp_path / "there", 3)
