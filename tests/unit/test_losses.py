"""shard/losses.py: the applied updates a shard lost, from the steps its replicas pulled."""

from __future__ import annotations

from distbelief.runtime.shard.losses import LostUpdates


def test_a_push_pulled_in_an_earlier_life_counts_what_this_life_began_behind_it() -> None:
    lost = LostUpdates(shard=0)
    lost.new_life(step=500)                             # restored at step 500
    assert not lost.seen(pulled=490, step=500)          # an ordinary stale push
    assert lost.seen(pulled=700, step=500) and lost.total == 200
    assert not lost.seen(pulled=690, step=501)          # the same loss, seen by another replica
    # pulled later in the old life, and seen after this life applied 40 updates of its own
    assert lost.seen(pulled=710, step=540) and lost.total == 210
    assert not lost.seen(pulled=560, step=560)          # pulled in this life


def test_the_losses_of_successive_lives_add_up_and_survive_a_checkpoint() -> None:
    lost = LostUpdates(shard=0)
    lost.new_life(step=200)
    lost.seen(pulled=300, step=200)
    lost.new_life(step=250)                             # restored again, or a copy took over
    assert lost.seen(pulled=260, step=255) and lost.total == 110
    restarted = LostUpdates(shard=0)
    restarted.new_life(step=100)                        # its checkpoint's state, then the count it kept
    restarted.restore(lost.total)
    assert not restarted.seen(pulled=100, step=100) and restarted.total == 110
    assert restarted.seen(pulled=130, step=101) and restarted.total == 140
