"""Issue 42: with backups: 2, SIGKILL the primary, then the copy that takes over once it has
acknowledged a few pushes. At most two of the three copies were faulty at once, so no
acknowledged push may be lost, none applied twice, and the shard's step never goes back."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

from distbelief.runtime.transport import zmq_transport

from support.copyprocesses import CopyProcesses, Pushes, applied_counts, final_verdict, push_as_one_peer
from support.paths import REPO
from support.waiting import eventually

sys.path.insert(0, str(REPO / "benchmarks"))

import copyverdict

ACKED_BY_THE_NEW_PRIMARY = 5


def _killed_twice(copies: CopyProcesses, pushes: Pushes) -> dict:
    """Kill the primary; as soon as a backup took over and acknowledged a few pushes, kill it too;
    start both again, as local mode and the kubelet do."""
    first = copies.record()
    copies.kill(first.primary)
    second = eventually(lambda: (r := copies.record()) is not None and r.view > first.view and r, 30,
                        interval=0.005, what="a backup takes over")
    took_over = time.monotonic()
    eventually(lambda: pushes.acknowledged(after=took_over) >= ACKED_BY_THE_NEW_PRIMARY, 30, interval=0.002,
               what="the new primary acknowledges pushes")
    copies.kill(second.primary)
    copies.start(first.primary)
    copies.start(second.primary)
    return {"killed": [first.primary, second.primary], "in_sync_after_takeover": second.in_sync}


@pytest.mark.heavy
def test_killing_the_primary_and_then_the_copy_that_took_over_loses_and_repeats_no_push(tmp_path: Path) -> None:
    copies = CopyProcesses(tmp_path)
    for rank in range(3):
        copies.start(rank)
    eventually(copies.in_sync, 30, what="one copy leads with two backups")
    pushes = Pushes(copies, copyverdict.Op).start()
    try:
        eventually(lambda: pushes.acknowledged() >= 50, 30, what="pushes acknowledged")
        kills = _killed_twice(copies, pushes)
        eventually(copies.in_sync, 90, what="the copies in sync again")
        resumed = pushes.acknowledged()
        eventually(lambda: pushes.acknowledged() >= resumed + 20, 30, what="pushes go on")
    finally:
        pushes.stop()
    verdict, found = final_verdict(copies, pushes, copyverdict.verdict)
    print(kills, found)
    assert verdict["lost"]["count"] == 0 and verdict["duplicated"]["count"] == 0, found
    assert not verdict["went_back"] and verdict["phantom"]["count"] == 0, found
    assert verdict["steps_match_applied"] == [True], found
    saved = copies.newest_checkpoints()
    assert len({c.step for c in saved.values()}) == 1, {r: c.step for r, c in saved.items()}
    for ckpt in saved.values():
        np.testing.assert_array_equal(ckpt.arrays["params"], saved[0].arrays["params"])


def test_a_push_resent_to_copies_restarted_from_their_checkpoints_is_answered_not_applied_again(
        tmp_path: Path) -> None:
    """How a push came to be applied twice in issue 42: a copy that goes back to its checkpoint
    (a restart, or a catch-up that broke off) takes the state, and must take the record of each
    peer's last command that goes with it, or a push the checkpoint holds is applied again when
    its replica, whose reply was lost, sends it again."""
    copies = CopyProcesses(tmp_path, checkpoint_every=0.2)
    for rank in range(3):
        copies.start(rank)
    eventually(copies.in_sync, 30, what="one copy leads with two backups")
    link = zmq_transport.default().link(copies.addresses, None)
    assert push_as_one_peer(link, seq=41, push_id=7).step == 1
    eventually(lambda: {c.step for c in copies.newest_checkpoints().values()} == {1} and
               len(copies.newest_checkpoints()) == 3, 10, what="every copy checkpointed the push")
    for rank in range(3):  # more faults than backups: the shard goes back to its newest checkpoint
        copies.kill(rank)
    for rank in range(3):
        copies.start(rank)
    again = push_as_one_peer(link, seq=41, push_id=7)
    after = push_as_one_peer(link, seq=42, push_id=8)  # and a new push is applied
    link.close()
    counts, step = applied_counts(copies)
    copies.stop()
    assert {"resent": again.step, "new": after.step, "final": step, "applications": [counts[7], counts[8]]} == {
        "resent": 1, "new": 2, "final": 2, "applications": [1, 1]}
