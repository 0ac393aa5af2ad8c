"""The client side of a peer with copies: a parameter shard and its backups
(spec.parameterServers.backups).

A client's link to such a shard holds every copy's address and uses one at a time; each
reconnect (after a disconnect, a silence, or a copy saying it is not the primary) moves
it to the next copy, so a replica finds the shard's primary wherever it now runs.
"""

from __future__ import annotations

import time
from typing import Sequence

WRAP_PAUSE_SECONDS = 0.2  # a link that went round all its copies waits this long before the next round


class CopyAddresses:
    """The addresses of one peer's copies (a shard and its backups), and the one in use:
    each reconnect moves to the next, pausing briefly after a whole round."""

    def __init__(self, addresses: str | Sequence[str]) -> None:
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        self.turn = 0

    @property
    def address(self) -> str:
        return self.addresses[self.turn]

    def next(self) -> None:
        if len(self.addresses) == 1:
            return
        self.turn = (self.turn + 1) % len(self.addresses)
        if self.turn == 0:
            time.sleep(WRAP_PAUSE_SECONDS)
