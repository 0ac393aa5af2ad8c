"""The replica's (and the chief's, and the coordinator's) view of a job's shards.

    group.request(op, ...)   one request to every shard at once, the replies collected:
                             each shard gets its slice of a flat array (the layout's) or
                             its own entry of a list, and reply arrays land straight in
                             the caller's
    hello, stats, done       the core's ops

It knows no parameter kind: the dense slices' pull and push are params/dense_client.py's,
the sparse rows' params/rows/row_client.py's, each over request().

The sockets, timeouts and resends are the transport's (fanout.exchange under one
RetryPolicy); this module builds the frames of each op and reads the replies, turning
error replies into errors by their code: LayoutMismatch for another layout, ShardRefused
for the rest. A shard acts on a resent command once (the shard core keeps each peer's
last command and its reply). A shard with backups is given as its copies' addresses: its
link moves to the next copy when one breaks, stays silent or answers NOT_PRIMARY.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from typing import Any, Sequence

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.transport import fanout, interface, zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.protocol import ErrorCode, Header, OpSpec, Status


Arrays = np.ndarray | Sequence[np.ndarray]  # a flat vector over the group's shards, or one array per shard


@dataclasses.dataclass(frozen=True)
class Reply:
    header: Header
    meta: Any = None   # the op's reply payload, decoded

    @property
    def done(self) -> bool:
        return self.header.status == Status.DONE

    @property
    def stale(self) -> bool:
        return self.header.status == Status.STALE

    @property
    def step(self) -> int:
        return self.header.step


@dataclasses.dataclass(frozen=True)
class Timeouts:
    request: float = 10.0        # one attempt
    unavailable: float = 300.0   # give up on a shard after this long without an answer

    def policy(self) -> fanout.RetryPolicy:
        return fanout.RetryPolicy(attempt=self.request, give_up=self.unavailable)


class ShardGroup:
    """The shards of one job, as seen by one replica (or by the chief): all of them, or
    (a partition of a model-parallel replica) the consecutive ones holding its stage."""

    def __init__(self, addresses: Sequence[str | Sequence[str]], layout: Layout, *, worker_id: int | None = None,
                 timeouts: Timeouts = Timeouts(), transport_: interface.Transport | None = None,
                 security: dict | None = None, stop: threading.Event | None = None,
                 shards: Sequence[int] | None = None) -> None:
        """addresses: each shard's, or each shard's copies' (primary first, then its backups);
        shards: the ones this group talks to (default all);
        security: the job keys' client socket options (keys.JobKeys.client_options)."""
        if len(addresses) != layout.shards:
            raise errors.ConfigError(f"{len(addresses)} shard addresses for {layout.shards} shards")
        self.layout = layout
        self.indices = list(range(layout.shards) if shards is None else shards)
        self.addresses = [addresses[i] for i in self.indices]
        self.base = layout.bounds(self.indices[0])[0]  # where the group's flat vector begins
        self.values = layout.bounds(self.indices[-1])[1] - self.base
        self.worker_id = worker_id if worker_id is not None else random.getrandbits(32)
        self.policy, self._timeouts, self._security = timeouts.policy(), timeouts, security
        self.stop = stop or threading.Event()  # set: a waiting request gives up (Stopped)
        self._transport = transport_ or zmq_transport.default()
        # bulk: parameters and gradients go AES-GCM-sealed beside CurveZMQ (sessions.py)
        self._links = [self._transport.link(a, security, bulk=True) for a in self.addresses]
        self._seq = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.retries = 0

    def close(self) -> None:
        for link in self._links:
            link.close()

    def subgroup(self, shards: Sequence[int]) -> "ShardGroup":
        """A group of some of this group's shards, reached alike (each shard's copies, the same
        timeouts, keys, worker id and stop), over links of its own."""
        by_shard = dict(zip(self.indices, self.addresses))
        missing = [s for s in shards if s not in by_shard]
        if missing:
            raise errors.ConfigError(f"shards {missing} are not in this group's {self.indices}")
        addresses = [by_shard.get(i, "") for i in range(self.layout.shards)]
        return ShardGroup(addresses, self.layout, worker_id=self.worker_id, timeouts=self._timeouts,
                          transport_=self._transport, security=self._security, stop=self.stop, shards=shards)

    # -- the core's ops ----------------------------------------------------------------------

    def hello(self) -> list[Reply]:
        return self.request(protocol.HELLO)

    def stats(self) -> list[dict]:
        return [r.meta.value if r.meta else {} for r in self.request(protocol.STATS)]

    def done(self, reason: str, outcome: str) -> list[Reply]:
        return self.request(protocol.DONE, meta=protocol.JsonObject({"reason": reason, "outcome": outcome}))

    # -- one request to every shard at once ------------------------------------------------------

    def request(self, op: OpSpec, *, meta: protocol.Payload | Sequence[protocol.Payload] | None = None,
                array: Arrays | None = None, receive_into: Arrays | None = None,
                steps: Sequence[int] | None = None) -> list[Reply]:
        """array: a flat vector each shard gets its slice of (the dense layout's), or one
        array per shard; receive_into: likewise, what the replies' arrays fill; meta: one
        payload for every shard, or one per shard. Lists go in the group's shard order."""
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        shards = range(len(self.indices))
        headers = [Header(op=op.code, shard=self.indices[i], layout=self.layout.hash, seq=self._seq,
                          worker=self.worker_id, step=steps[i] if steps else 0,
                          count=0 if array is None else self._part(i, array).size)
                   for i in shards]
        metas = list(meta) if isinstance(meta, Sequence) else [meta] * len(shards)
        requests = [[h.pack(), *self._body(i, metas[i], array)] for i, h in enumerate(headers)]
        exchange = fanout.Exchange(self._links, requests, self.policy,
                                      names=[f"shard {self.indices[i]} at {link.address}"
                                             for i, link in enumerate(self._links)])
        replies: dict[int, Reply] = {}

        def accept(i: int, received: interface.Received) -> bool | str:
            self.bytes_in += received.nbytes
            try:
                reply = self._read(i, op, headers[i], received, receive_into)
            except errors.NotPrimary:
                return fanout.REDIRECT  # a backup: on to the shard's next copy
            if reply is not None:
                replies[i] = reply
            return reply is not None

        def sink(i: int) -> interface.Sink | None:
            return None if receive_into is None else self._sink(i, op, headers[i], receive_into)

        try:
            fanout.exchange(self._transport, exchange, accept=accept, stop=self.stop, sink=sink)
        finally:
            self.bytes_out += exchange.bytes_out
            self.retries += exchange.resends
        return [replies[i] for i in shards]

    def _body(self, position: int, meta: protocol.Payload | None, array: np.ndarray | None) -> list:
        body: list = [meta.pack()] if meta is not None else []
        if array is not None:
            body.append(memoryview(self._part(position, array)))
        return body

    def _part(self, position: int, arrays: Arrays) -> np.ndarray:
        """The group's position-th shard's array: its slice of the group's flat vector, or its
        entry of a per-shard list."""
        if isinstance(arrays, np.ndarray):
            start, stop = self.layout.bounds(self.indices[position])
            return arrays[start - self.base:stop - self.base]
        return arrays[position]

    def _sink(self, position: int, op: OpSpec, request: Header, out: Arrays) -> interface.Sink:
        array_frame = 1 if op.reply is not None else 0  # the reply's meta, if any, comes first

        def where(frame: memoryview, index: int) -> np.ndarray | None:
            if index != array_frame:
                return None
            header = protocol.unpack_header(frame)
            if header.seq != request.seq or header.status not in (Status.OK, Status.STALE):
                return None  # a reply to an earlier request, or an error's text: not parameters
            return self._part(position, out)
        return where

    def _read(self, position: int, op: OpSpec, request: Header, received: interface.Received,
              receive_into: Arrays | None) -> Reply | None:
        """The reply of one shard; None if it was a stale one (an earlier seq)."""
        header = protocol.unpack_header(received.header)
        if header.seq != request.seq or header.shard != request.shard:
            return None
        address, shard = self._links[position].address, request.shard
        if header.status == Status.ERROR:
            text = protocol.decode_text(received.frames[0]) if received.frames else ""
            if header.error == ErrorCode.NOT_PRIMARY:
                raise errors.NotPrimary(text)
            if header.error == ErrorCode.LAYOUT:
                raise errors.LayoutMismatch(f"shard {shard} at {address} refused us: {text}")
            raise errors.ShardRefused(f"shard {shard} at {address} refused {op.name}: {text}")
        if header.status not in (Status.OK, Status.STALE):
            return Reply(header=header)
        if op.reply_array and receive_into is not None:
            values = self._part(position, receive_into).size
            expected = values * op.dtype.itemsize
            if header.count != values or received.into_sink != expected:
                raise errors.ProtocolError(f"shard {shard} sent {received.into_sink} bytes, expected {expected}")
        if op.reply is None:
            return Reply(header=header)
        if not received.frames:
            raise errors.ProtocolError(f"shard {shard} at {address} answered {op.name} without its payload")
        return Reply(header=header, meta=op.reply.unpack(received.frames[0]))
