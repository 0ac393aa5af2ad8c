"""shard/reshard.py: checkpoints re-cut for another shard count hold the same values, bit
for bit, and what cannot be re-cut is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from distbelief.runtime import errors
from distbelief.runtime.shard.checkpoint import Checkpoint, decode, encode
from distbelief.runtime.shard.reshard import Recut, recut
from distbelief.runtime.shard.resends import CHECKPOINT_KEY
from distbelief.runtime.wire.layout import Layout

SHAPES = [("w", (10, 7)), ("b", (7,)), ("v", (7, 3))]


def checkpoints(layout: Layout, *, seed: int = 0, **meta: object) -> list[Checkpoint]:
    """One checkpoint per shard of layout: random parameters and Adagrad accumulators, shard
    0 a step ahead of the others (each shard counts its own updates)."""
    rng = np.random.default_rng(seed)
    return [Checkpoint(step=500 if shard == 0 else 499, layout=layout.hash, shard=shard,
                       arrays={"params": rng.standard_normal(layout.size(shard)).astype(np.float32),
                               "adagrad_accumulator": rng.random(layout.size(shard)).astype(np.float32)},
                       meta={"optimizer": "adagrad", "startTime": 7.0 + shard, "examples": 1000 + shard,
                             CHECKPOINT_KEY: [["peer", shard]], **meta})
            for shard in range(layout.shards)]


def flat(ckpts: list[Checkpoint], name: str) -> np.ndarray:
    return np.concatenate([c.arrays[name] for c in ckpts])


def written(recuts: list[Recut]) -> list[Checkpoint]:
    """The new checkpoints as a shard reads them after checkpoint.write."""
    return [decode(b"".join(bytes(part) for part in encode(r.header, r.pieces)), f"shard {r.header.shard}")
            for r in recuts]


@pytest.mark.parametrize(("before", "after", "stages"), [(2, 3, ()), (4, 2, ()), (3, 1, ()), (2, 5, (70,)),
                                                         (4, 3, (70, 80))])
def test_a_recut_holds_every_value_and_cutting_back_gives_the_original_bits(before: int, after: int,
                                                                            stages: tuple[int, ...]) -> None:
    old_layout, new_layout = Layout.of(SHAPES, before, stages), Layout.of(SHAPES, after, stages)
    old = checkpoints(old_layout)
    new = written(recut(old, old_layout, new_layout))
    assert [c.shard for c in new] == list(range(after))
    assert all(c.layout == new_layout.hash and c.arrays["params"].size == new_layout.size(c.shard) for c in new)
    for name in ("params", "adagrad_accumulator"):
        assert flat(new, name).tobytes() == flat(old, name).tobytes()
    back = written(recut(new, new_layout, old_layout))
    for mine, theirs in zip(back, old):
        assert mine.arrays.keys() == theirs.arrays.keys()
        assert all(mine.arrays[k].tobytes() == theirs.arrays[k].tobytes() for k in mine.arrays)


def test_the_new_shards_take_the_global_step_and_the_chief_s_figures_without_the_old_commands() -> None:
    old_layout, new_layout = Layout.of(SHAPES, 2), Layout.of(SHAPES, 3)
    new = written(recut(checkpoints(old_layout), old_layout, new_layout))
    assert {c.step for c in new} == {500}
    assert all(c.meta == {"optimizer": "adagrad", "startTime": 7.0, "examples": 1000} for c in new)


@pytest.mark.parametrize(("meta", "arrays", "message"), [
    ({"sparseDim": 8}, None, "holds embedding rows"),
    ({"finished": {"phase": "Succeeded"}}, None, "the job has finished"),
    (None, {"extra": np.zeros(3, dtype=np.float32)}, "extra not one value per parameter"),
])
def test_what_cannot_be_recut_is_refused_by_name(meta: dict | None, arrays: dict | None, message: str) -> None:
    old_layout = Layout.of(SHAPES, 2)
    old = checkpoints(old_layout)
    for ckpt in old:
        ckpt.meta.update(meta or {})
        ckpt.arrays.update(arrays or {})
    with pytest.raises(errors.ReshardError, match=message):
        recut(old, old_layout, Layout.of(SHAPES, 3))


def test_state_of_one_shard_s_own_is_refused_by_its_key() -> None:
    old_layout = Layout.of(SHAPES, 2)
    old = checkpoints(old_layout)
    old[0].meta["sandblaster"] = {"iteration": 3}
    with pytest.raises(errors.ReshardError, match="shard 1's checkpoint .*: sandblaster differs from shard 0's"):
        recut(old, old_layout, Layout.of(SHAPES, 3))


def test_checkpoints_of_another_layout_or_model_are_refused() -> None:
    old_layout = Layout.of(SHAPES, 2)
    with pytest.raises(errors.ReshardError, match="expected shard 0 of"):
        recut(checkpoints(Layout.of(SHAPES, 3))[:2], old_layout, Layout.of(SHAPES, 4))
    with pytest.raises(errors.ReshardError, match="another model"):
        recut(checkpoints(old_layout), old_layout, Layout.of([("w", (10, 7))], 3))
