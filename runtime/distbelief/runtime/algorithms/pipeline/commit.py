"""Partition 0's side of a step's commit: the step is applied on every shard or on none.

Once every stage's gradient is held (staged.py has the shards' side), partition 0 asks
every shard of the model at once:

    PREPARE_HELD   every shard pins its part; one that lost it answers an error
    APPLY_HELD     only when every shard pinned its part
    DROP_HELD      otherwise, and for a step that was not to be applied at all (too stale
                   somewhere, a shard without room, a non-finite loss): its holds go now,
                   not when they would expire

A shard without room for a HOLD answers FULL; the group then waits (Backoff) before its
next step, so that the steps of the groups ahead of it can commit and free the room.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading

from distbelief.runtime import errors
from distbelief.runtime.algorithms.pipeline.ops import APPLY_HELD, DROP_HELD, PREPARE_HELD, ApplyHeld, Held
from distbelief.runtime.client.group import ShardGroup
from distbelief.runtime.wire.protocol import Status

log = logging.getLogger(__name__)

BACKOFF_SECONDS = (0.05, 2.0)  # the first and the longest wait after a shard had no room to hold a step


def new_token() -> int:
    """A step's token: unpredictable, so no other peer can name a step it was not told of."""
    return secrets.randbits(64)


class Commit:
    """The commits of one partition-0 pod, over `everyone`: every shard of the model."""

    def __init__(self, everyone: ShardGroup) -> None:
        self.everyone = everyone

    def settle(self, group: int, token: int, held: int, *, examples: int, loss: float) -> int:
        """The step whose gradients were held with status `held` (the worst of every
        stage's HOLD), applied everywhere or dropped everywhere: OK, STALE (not applied: too
        stale somewhere, or a shard lost its part), FULL (not applied: a shard had no room)
        or DONE."""
        if held == Status.DONE:
            return Status.DONE
        if held != Status.OK:
            return self.drop(group, token, held)
        try:
            if any(r.done for r in self.everyone.request(PREPARE_HELD, meta=Held(group, token))):
                return Status.DONE
        except errors.ShardRefused as exc:  # a shard lost its part: no shard applies the step
            log.warning("event=step_not_applied group=%016x reason=%r", group, str(exc))
            return self.drop(group, token, Status.STALE)
        try:
            replies = self.everyone.request(APPLY_HELD, meta=ApplyHeld(group, token, examples, loss))
        except errors.ShardRefused as exc:  # a shard restarted since it pinned its part
            log.warning("event=apply_incomplete group=%016x reason=%r", group, str(exc))
            return Status.STALE
        return Status.DONE if any(r.done for r in replies) else Status.OK

    def drop(self, group: int, token: int, status: int) -> int:
        """Release the step's holds on every shard (it will not be applied): status, or DONE."""
        replies = self.everyone.request(DROP_HELD, meta=Held(group, token))
        return Status.DONE if any(r.done for r in replies) else status


class Backoff:
    """Waits after FULL refusals: doubling from the first to the longest, each drawn
    between half and all of it, so groups refused together come back apart."""

    def __init__(self) -> None:
        self.waited = 0      # back-offs so far
        self._next = BACKOFF_SECONDS[0]

    def wait(self, stop: threading.Event) -> None:
        seconds = random.uniform(self._next / 2, self._next)  # spreads the groups out; not a secret
        self._next = min(2 * self._next, BACKOFF_SECONDS[1])
        self.waited += 1
        log.info("event=hold_refused reason=full action=back_off seconds=%.2f", seconds)
        stop.wait(seconds)

    def reset(self) -> None:
        self._next = BACKOFF_SECONDS[0]
