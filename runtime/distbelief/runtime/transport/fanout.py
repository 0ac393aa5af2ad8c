"""One request to several links at once, the replies collected under one RetryPolicy.

    exchange()    send requests[i] to links[i] for every i, and wait until each reply is
                  accepted: a silent peer gets the request again on a fresh connection,
                  a broken one at once, a backup that refuses (REDIRECT) on its next copy;
                  one silent for the policy's give_up is ShardUnavailable

It works over the transport interface (interface.py), for either transport.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Sequence

from distbelief.runtime import errors
from distbelief.runtime.transport.interface import (
    STOP_POLL_SECONDS, Frame, Link, Received, Sink, Transport, frames_nbytes)

log = logging.getLogger(__name__)

REDIRECT = "redirect"     # accept()'s verdict on a refusal from a shard's backup: try its next copy


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How a client waits for a peer: each attempt gets `attempt` seconds, then the request
    goes again on a fresh connection; after `give_up` seconds without an answer the peer is
    unavailable (None: never give up). A broken connection resends at once when
    `resend_on_disconnect` (a restarted shard then costs its restart time, not a timeout)."""

    attempt: float = 10.0
    give_up: float | None = 300.0
    resend_on_disconnect: bool = True


@dataclasses.dataclass
class Exchange:
    """The state of one request sent to several links: what each gets, what came back."""

    links: Sequence[Link]
    requests: Sequence[Sequence[Frame]]
    policy: RetryPolicy
    names: Sequence[str]  # how errors name each peer ("shard 1 at tcp://...")
    bytes_out: int = 0
    resends: int = 0


def exchange(transport: Transport, ex: Exchange, *, accept: Callable[[int, Received], bool | str],
             stop: threading.Event, sink: Callable[[int], Sink | None] = lambda i: None) -> None:
    """Send requests[i] to links[i] for every i, then wait until accept(i, reply) has said
    True for each. A reply accept() turns down (a stale answer to an earlier attempt), or
    one the link refused (receive() gave None), is skipped; one it answers REDIRECT sends the
    request to the link's next copy. A link that breaks gets the request again at once (once per attempt); one
    silent for policy.attempt gets it again on a fresh connection; one silent for
    policy.give_up raises ShardUnavailable. A set stop raises Stopped."""
    pending = set(range(len(ex.links)))
    for i in pending:
        ex.links[i].broke()  # a break before this request cost it nothing
        _send(ex, i)
    started = time.monotonic()
    attempt_deadline = started + ex.policy.attempt
    resent: set[int] = set()
    while pending:
        if stop.is_set():
            raise errors.Stopped("stopped while waiting for an answer")
        timeout = min(STOP_POLL_SECONDS, max(0.0, attempt_deadline - time.monotonic()))
        ready = transport.wait([ex.links[i] for i in pending], timeout)
        for i in list(pending):
            link = ex.links[i]
            received = link.receive(sink(i)) if link.readable(ready) else None
            verdict = accept(i, received) if received is not None else False
            if verdict == REDIRECT:
                _resend(ex, i)
            elif verdict:
                pending.discard(i)  # a reply that beat a disconnect counts
            elif ex.policy.resend_on_disconnect and link.broke(ready) and i not in resent:
                resent.add(i)
                log.warning("event=peer_disconnected peer=%r action=resend", ex.names[i])
                _resend(ex, i)
        if pending and time.monotonic() >= attempt_deadline:
            _retry_silent(ex, pending, time.monotonic() - started)
            attempt_deadline = time.monotonic() + ex.policy.attempt
            resent.clear()


def _send(ex: Exchange, i: int) -> None:
    if ex.links[i].send(ex.requests[i]):
        ex.bytes_out += frames_nbytes(ex.requests[i])


def _resend(ex: Exchange, i: int) -> None:
    ex.resends += 1
    ex.links[i].reconnect()
    _send(ex, i)


def _retry_silent(ex: Exchange, pending: set[int], waited: float) -> None:
    give_up = ex.policy.give_up
    for i in pending:
        if give_up is not None and waited >= give_up:
            raise errors.ShardUnavailable(f"{ex.names[i]} has not answered for {waited:.0f} s")
        log.warning("event=peer_silent peer=%r waited_s=%.1f action=reconnect", ex.names[i], waited)
        _resend(ex, i)
