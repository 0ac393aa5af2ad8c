"""The replica's side of the wire: one DEALER socket per shard, requests sent to every
shard at once and then collected, with timeouts, reconnects and retries.

A request lost with its connection (the shard restarted, or the link broke) is sent
again as soon as ZeroMQ reports the disconnect, on a fresh socket, rather than after the
request timeout: a restarted shard costs the replicas its restart time, not 10 s. The
fresh socket drops any copy still queued on the old one; a shard acts on a resent
command once (Shard keeps each peer's last command and its reply).

ZeroMQ errors and silences are translated here into ShardUnavailable / ShardRefused /
LayoutMismatch; callers never see zmq. Parameter payloads are received straight into
the caller's array (recv_into: one copy out of libzmq's buffer, no array allocated per
pull); pushes send views of the caller's gradient without copying them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import time
from typing import Sequence

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from distbelief.runtime import errors, protocol
from distbelief.runtime.layout import Layout
from distbelief.runtime.protocol import Header, Op, Status

log = logging.getLogger(__name__)

STOP_POLL_SECONDS = 0.25  # how often a waiting round looks at its stop event


@dataclasses.dataclass(frozen=True)
class Reply:
    header: Header
    payload: bytes = b""   # a small reply payload (text or a fixed struct), never parameters

    @property
    def text(self) -> str:
        return self.payload.decode("utf-8", errors="replace")

    @property
    def done(self) -> bool:
        return self.header.status == Status.DONE


@dataclasses.dataclass(frozen=True)
class Timeouts:
    request: float = 10.0        # one attempt
    unavailable: float = 300.0   # give up on a shard after this long without an answer


class Connection:
    """One DEALER socket to one shard, recreated after a silence or a disconnect (which
    drops stale replies and requests still queued). With watch, a monitor reports
    disconnects; it must then be read (disconnected()), or its queue fills and stalls
    the context's I/O thread."""

    def __init__(self, context: zmq.Context, address: str, shard: int, security: dict | None, *,
                 watch: bool = True) -> None:
        self.context, self.address, self.shard, self.security = context, address, shard, security
        self.watch = watch
        self.socket, self.monitor = self._connect()

    def _connect(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        socket, monitor = self.context.socket(zmq.DEALER), None
        try:
            socket.setsockopt(zmq.LINGER, 0)
            for option, value in (self.security or {}).items():
                socket.setsockopt(option, value)
            if self.watch:
                monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            socket.connect(self.address)
        except zmq.ZMQError:
            if monitor is not None:
                monitor.close(linger=0)
            socket.close(linger=0)
            raise
        self.handshaken = False
        return socket, monitor

    def disconnected(self) -> bool:
        """Whether a connection that had completed its handshake broke since the last call.
        (A refused handshake ends in a disconnect too; that one lost no request.)"""
        broke = False
        while self.monitor is not None and self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshaken = True
            elif self.handshaken:
                self.handshaken, broke = False, True
        return broke

    def reconnect(self) -> None:
        self.close()
        self.socket, self.monitor = self._connect()

    def close(self) -> None:
        if self.socket.closed:
            return
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
        self.socket.close(linger=0)


class ShardGroup:
    """All shards of one job, as seen by one replica (or by the chief)."""

    def __init__(self, addresses: Sequence[str], layout: Layout, *, worker_id: int | None = None,
                 timeouts: Timeouts = Timeouts(), context: zmq.Context | None = None,
                 security: dict | None = None, stop: threading.Event | None = None) -> None:
        """security: the job keys' client socket options (keys.JobKeys.client_options)."""
        if len(addresses) != layout.shards:
            raise errors.ConfigError(f"{len(addresses)} shard addresses for {layout.shards} shards")
        self.layout = layout
        self.worker_id = worker_id if worker_id is not None else random.getrandbits(32)
        self.timeouts = timeouts
        self.stop = stop or threading.Event()  # set: a waiting round gives up (Stopped)
        self._context = context or zmq.Context.instance()
        self._connections = [Connection(self._context, a, i, security) for i, a in enumerate(addresses)]
        self._seq = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.retries = 0

    def close(self) -> None:
        for connection in self._connections:
            connection.close()

    # -- the ops ---------------------------------------------------------------------

    def hello(self) -> list[Reply]:
        return self._round(Op.HELLO)

    def stats(self) -> list[dict]:
        return [json.loads(r.text or "{}") for r in self._round(Op.STATS)]

    def pull(self, out: np.ndarray) -> list[Reply]:
        """Fill out (the full flat vector) with every shard's slice; the replies carry steps."""
        return self._round(Op.PULL, receive_into=out)

    def push(self, grad: np.ndarray, *, steps: Sequence[int], examples: int, loss: float) -> list[Reply]:
        """Send each shard its slice of grad; steps[i] is the step pulled from shard i."""
        return self._round(Op.PUSH, payload=grad, steps=steps, examples=examples, loss=loss)

    def push_and_pull(self, grad: np.ndarray, out: np.ndarray, *, steps: Sequence[int], examples: int,
                      loss: float) -> list[Reply]:
        """push, then fill out with the parameters that include it: one round trip, not two."""
        return self._round(Op.PUSH_PULL, payload=grad, receive_into=out, steps=steps, examples=examples, loss=loss)

    def done(self, reason: str, outcome: str) -> list[Reply]:
        text = json.dumps({"reason": reason, "outcome": outcome})
        return self._round(Op.DONE, data=text.encode())

    # -- Sandblaster: the coordinator's commands and the replicas' work units ----------

    def begin_evaluation(self, evaluation: int, units: int) -> list[Reply]:
        return self._round(Op.BEGIN_EVAL, step=evaluation, count=units)

    def pull_point(self, out: np.ndarray) -> list[Reply]:
        """Fill out with the trial point; each reply's step is that shard's evaluation id."""
        return self._round(Op.PULL_POINT, receive_into=out)

    def accumulate(self, grad: np.ndarray, *, evaluation: int, unit: int) -> list[Reply]:
        return self._round(Op.ACCUMULATE, payload=grad, step=evaluation, examples=unit)

    def vector(self, command: protocol.VectorCommand) -> list[Reply]:
        return self._round(Op.VECTOR, data=command.pack())

    def commit(self, iteration: int, state: dict) -> list[Reply]:
        return self._round(Op.COMMIT, step=iteration, data=json.dumps(state).encode())

    def rollback(self, iteration: int) -> list[Reply]:
        return self._round(Op.ROLLBACK, step=iteration)

    def sandblaster_state(self) -> list[Reply]:
        return self._round(Op.STATE)

    # -- one request to every shard at once -------------------------------------------

    def _round(self, op: Op, *, payload: np.ndarray | None = None, receive_into: np.ndarray | None = None,
               steps: Sequence[int] | None = None, step: int = 0, count: int = 0, examples: int = 0,
               loss: float = 0.0, data: bytes | None = None) -> list[Reply]:
        """payload: a flat vector each shard gets its slice of; data: bytes every shard gets."""
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        targets = list(range(self.layout.shards))
        headers = {i: Header(op=op, shard=i, layout=self.layout.hash, seq=self._seq, worker=self.worker_id,
                             step=steps[i] if steps else step, examples=examples, loss=loss,
                             count=self.layout.size(i) if payload is not None else count)
                   for i in targets}
        bodies = {i: self._body(i, payload, data) for i in targets}
        for i in targets:
            self._connections[i].disconnected()  # a break before this request cost it nothing
            self._send(i, headers[i], bodies[i])
        replies: dict[int, Reply] = {}
        pending = set(targets)
        resent: set[int] = set()  # resent to on a disconnect in this attempt: once each, then the timeout
        started = {i: time.monotonic() for i in targets}
        attempt_deadline = time.monotonic() + self.timeouts.request
        while pending:
            poller = zmq.Poller()
            for i in pending:
                poller.register(self._connections[i].socket, zmq.POLLIN)
                if self._connections[i].monitor is not None:
                    poller.register(self._connections[i].monitor, zmq.POLLIN)
            if self.stop.is_set():
                raise errors.Stopped("stopped while waiting for the shards")
            timeout_ms = min(STOP_POLL_SECONDS, max(0.0, attempt_deadline - time.monotonic())) * 1000
            ready = dict(poller.poll(timeout_ms))
            for i in list(pending):
                connection = self._connections[i]
                if connection.socket in ready:  # a reply that beat the disconnect counts
                    reply = self._receive(i, headers[i], receive_into)
                    if reply is not None:
                        replies[i] = reply
                        pending.discard(i)
                        continue
                if connection.monitor in ready and connection.disconnected() and i not in resent:
                    resent.add(i)
                    log.warning("event=shard_disconnected shard=%d address=%s action=resend", i, connection.address)
                    self._resend(i, headers[i], bodies[i])
            if pending and time.monotonic() >= attempt_deadline:
                for i in pending:
                    self._retry(i, headers[i], bodies[i], started[i])
                attempt_deadline = time.monotonic() + self.timeouts.request
                resent.clear()
        return [replies[i] for i in targets]

    def _body(self, shard: int, payload: np.ndarray | None, data: bytes | None) -> list:
        if payload is not None:
            start, stop = self.layout.bounds(shard)
            return [memoryview(payload[start:stop])]
        return [data] if data is not None else []

    def _send(self, shard: int, header: Header, body: list) -> None:
        frames = [header.pack(), *body]
        try:
            self._connections[shard].socket.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return  # the queue to this shard is full: the round's timeout retries it
        self.bytes_out += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)

    def _resend(self, shard: int, header: Header, body: list) -> None:
        """The request again, on a fresh connection (stale replies and queued copies dropped)."""
        self.retries += 1
        self._connections[shard].reconnect()
        self._send(shard, header, body)

    def _retry(self, shard: int, header: Header, body: list, started: float) -> None:
        connection = self._connections[shard]
        waited = time.monotonic() - started
        if waited >= self.timeouts.unavailable:
            raise errors.ShardUnavailable(
                f"shard {shard} at {connection.address} has not answered for {waited:.0f} s")
        log.warning("event=shard_silent shard=%d address=%s waited_s=%.1f action=reconnect",
                    shard, connection.address, waited)
        self._resend(shard, header, body)

    def _receive(self, shard: int, request: Header, receive_into: np.ndarray | None) -> Reply | None:
        """Read one reply from a shard; None if it was a stale one (an old seq)."""
        socket = self._connections[shard].socket
        header = protocol.unpack_header(socket.recv())
        self.bytes_in += protocol.HEADER.size
        more = socket.getsockopt(zmq.RCVMORE)
        if header.seq != request.seq or header.shard != shard:
            if more:
                socket.recv(copy=False)
            return None
        data = b""
        if more and header.status == Status.OK and receive_into is not None:
            self._receive_slice(socket, shard, header, receive_into)
        elif more:
            data = protocol.small_payload(socket.recv(copy=False).buffer)
            self.bytes_in += len(data)
        reply = Reply(header=header, payload=data)
        if header.status == Status.ERROR:
            address = self._connections[shard].address
            if "layout" in reply.text:
                raise errors.LayoutMismatch(f"shard {shard} at {address} refused us: {reply.text}")
            raise errors.ShardRefused(f"shard {shard} at {address} refused {Op(request.op).name}: {reply.text}")
        return reply

    def _receive_slice(self, socket: zmq.Socket, shard: int, header: Header, out: np.ndarray) -> None:
        start, stop = self.layout.bounds(shard)
        target = out[start:stop]
        nbytes = socket.recv_into(target)
        self.bytes_in += nbytes
        if header.count != stop - start or nbytes != target.nbytes:
            raise errors.ProtocolError(
                f"shard {shard} sent {nbytes} bytes, expected {target.nbytes}")
