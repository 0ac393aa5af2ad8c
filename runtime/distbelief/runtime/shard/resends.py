"""What a shard remembers of each peer's last command, so that a resend is applied once.

A peer is (its authenticated user, its connection's routing id); a command is known by
its seq and op. The reply is kept with it, unless it holds a parameter copy (a repeat
then gets a fresh one). A shard with backups hands the record to a copy that catches up
(export / load), and each copy records the commands it applies under the original peer,
so a resend that reaches a new primary is recognised there too.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from typing import Any

from distbelief.runtime import errors
from distbelief.runtime.wire.protocol import Header

CHECKPOINT_KEY = "lastCommands"  # the checkpoint metadata that holds LastCommands.export()
REMEMBERED_PEERS = 4096  # peers (replicas, the coordinator) whose last command a shard remembers

Peer = tuple  # (user or None, routing id)
Record = tuple[int, int, list | None]  # (seq, op, the reply's frames or None)


class LastCommands:
    def __init__(self, limit: int = REMEMBERED_PEERS) -> None:
        self.limit = limit
        self._records: OrderedDict[Peer, Record] = OrderedDict()

    def get(self, peer: Peer) -> Record | tuple[None, None, None]:
        return self._records.get(peer, (None, None, None))

    def remember(self, peer: Peer, seq: int, op: int, reply: list | None) -> None:
        self._records[peer] = (seq, op, reply)
        self._records.move_to_end(peer)
        if len(self._records) > self.limit:
            self._records.popitem(last=False)  # the peer heard from least recently

    def export(self) -> list[list[Any]]:
        """The record as JSON values, least recent peer first."""
        return [[user, peer.hex(), seq, op, None if reply is None else [_text(bytes(f)) for f in reply]]
                for (user, peer), (seq, op, reply) in self._records.items()]

    def load(self, entries: list[list[Any]]) -> None:
        """Replace the record by an exported one."""
        self._records.clear()
        for user, peer, seq, op, reply in entries[-self.limit:]:
            frames = None if reply is None else [base64.b64decode(f) for f in reply]
            self._records[(user, bytes.fromhex(peer))] = (int(seq), int(op), frames)


def repeat_of(commands: LastCommands, peer: Peer, header: Header) -> Record | None:
    """The peer's record of this very command if it sent it before, None for a new one;
    Refused for an earlier one (a copy that lingered on the way, on another connection: its
    peer has moved on, and it was applied when it first came)."""
    seq, op, reply = commands.get(peer)
    if seq is not None and 0 < (seq - header.seq) & 0xFFFFFFFF < 1 << 31:
        raise errors.Refused(f"command {header.seq} is older than this peer's last ({seq}): not applied again")
    return (seq, op, reply) if seq is not None and op is not None and (seq, op) == (header.seq, header.op) else None


def _text(frame: bytes) -> str:
    return base64.b64encode(frame).decode("ascii")
