"""What Downpour adds to each shard's core (a plugin.UpdateHook): warm-start admission, the
staleness of the pushes it applies, and the replicas' loss and how many of them push.

- Warm-start (spec.training.warmstartSteps): shard 0 lets one replica train alone until
  that many updates are applied; another that says HELLO is told to WAIT. The replica
  admitted keeps its lease while it pushes; silent for WARMSTART_LEASE_SECONDS, it loses it.
- Staleness: how many updates the shard applied between a push's pull and the push (a
  histogram and the largest, in the shard's metrics).
- The replicas' minibatch loss as a moving average (LOSS_EMA), and how many replicas pushed
  within the core's rate window: shard 0's figures for the chief's history and STATS.
"""

from __future__ import annotations

import time
from typing import Any

from distbelief.runtime.shard.core import RATE_WINDOW_SECONDS, Shard
from distbelief.runtime.shard.resends import REMEMBERED_PEERS
from distbelief.runtime.wire.protocol import Header

WARMSTART_LEASE_SECONDS = 10.0
LOSS_EMA = 0.05


class DownpourUpdates:
    def __init__(self, shard: Shard, *, warmstart_steps: int = 0) -> None:
        self.shard = shard
        self.warmstart_steps = warmstart_steps
        self._warm_owner: tuple[tuple, float] | None = None
        self._staleness_max = 0
        self._train_loss: float | None = None
        self._pushed_at: dict[tuple, float] = {}  # peer -> when it last pushed (replicas at work)

    def admit(self, peer: tuple) -> bool:
        """Shard 0 lets one replica train alone until warmstartSteps updates are applied."""
        if self.shard.index != 0 or self.shard.step >= self.warmstart_steps:
            return True
        now = time.monotonic()
        if self._warm_owner and self._warm_owner[0] != peer and now - self._warm_owner[1] < WARMSTART_LEASE_SECONDS:
            return False
        self._warm_owner = (peer, now)
        return True

    def applied(self, peer: tuple, header: Header, *, examples: int, loss: float) -> None:
        shard, now = self.shard, time.monotonic()
        staleness = shard.step - header.step if header.step <= shard.step else 0
        if self._warm_owner and self._warm_owner[0] == peer:
            self._warm_owner = (peer, now)
        shard.metrics.staleness.observe(staleness)
        if staleness > self._staleness_max:
            self._staleness_max = staleness
            shard.metrics.staleness_max.set(staleness)
        self._train_loss = loss if self._train_loss is None else (1 - LOSS_EMA) * self._train_loss + LOSS_EMA * loss
        self._pushed_at[peer] = now
        if len(self._pushed_at) > REMEMBERED_PEERS:
            self._pushed_at = dict(sorted(self._pushed_at.items(), key=lambda kv: kv[1])[-REMEMBERED_PEERS // 2:])
        shard.metrics.train_loss.set(self._train_loss)

    def figures(self) -> dict[str, Any]:
        """The replicas' mean minibatch loss, how many pushed within the rate window, and the
        examples per second per replica."""
        now = time.monotonic()
        replicas = sum(now - at <= RATE_WINDOW_SECONDS for at in list(self._pushed_at.values()))
        rate = self.shard.examples_per_second
        return {"trainLoss": self._train_loss, "replicas": replicas,
                "examplesPerSecondPerReplica": rate / replicas if replicas else None}
