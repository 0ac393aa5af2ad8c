"""shard/losses.py: the applied updates a shard lost, from the steps its replicas pulled."""

from __future__ import annotations

from distbelief.runtime.shard.losses import LostUpdates


def test_a_push_pulled_ahead_of_the_shard_counts_the_gap_once_per_life() -> None:
    lost = LostUpdates(shard=0)
    assert not lost.seen(pulled=90, step=100)          # an ordinary stale push
    assert lost.seen(pulled=700, step=500) and lost.total == 200
    assert not lost.seen(pulled=690, step=501)         # the same loss, seen by another replica
    assert lost.seen(pulled=710, step=502) and lost.total == 208   # a replica that had pulled later
    assert not lost.seen(pulled=600, step=600)


def test_the_losses_of_successive_lives_add_up_and_survive_a_checkpoint() -> None:
    lost = LostUpdates(shard=0)
    lost.seen(pulled=300, step=200)
    lost.new_life()                                      # restored again, or a copy took over
    assert lost.seen(pulled=260, step=250) and lost.total == 110
    restarted = LostUpdates(shard=0)
    restarted.restore(lost.total)                       # the count its checkpoint kept
    assert not restarted.seen(pulled=100, step=100) and restarted.total == 110
    assert restarted.seen(pulled=130, step=100) and restarted.total == 140
