"""A copy's view epoch (shard/copies/epoch.py): the highest view it was in, kept beside its
checkpoints, so that a claim after the view record was deleted does not reuse a number."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from distbelief.runtime.shard.copies.epoch import FILE, ViewEpoch


def test_the_highest_view_outlives_the_copy(tmp_path: Path) -> None:
    epoch = ViewEpoch(str(tmp_path / "ckpt"))       # the folder does not exist yet
    assert epoch.highest == 0
    epoch.remember(4)
    epoch.remember(2)                                # a lower view changes nothing
    assert epoch.highest == 4
    assert json.loads((tmp_path / "ckpt" / FILE).read_text()) == {"view": 4}
    assert ViewEpoch(str(tmp_path / "ckpt")).highest == 4
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [FILE]    # no temporary left


@pytest.mark.parametrize("text", ["{", '{"view": -3}', '{"view": "7"}', "[]"])
def test_an_unreadable_epoch_counts_as_none_and_says_so(tmp_path: Path, text: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / FILE).write_text(text)
    with caplog.at_level(logging.WARNING):
        epoch = ViewEpoch(str(tmp_path))
    assert epoch.highest == 0 and "event=view_epoch_unreadable" in caplog.text and FILE in caplog.text
    epoch.remember(3)
    assert ViewEpoch(str(tmp_path)).highest == 3


def test_an_epoch_that_cannot_be_saved_is_kept_in_memory_and_said(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    epoch = ViewEpoch(str(blocker / "ckpt"))        # under a file: no folder can be made
    with caplog.at_level(logging.WARNING):
        epoch.remember(5)
    assert epoch.highest == 5 and "event=view_epoch_not_saved" in caplog.text
