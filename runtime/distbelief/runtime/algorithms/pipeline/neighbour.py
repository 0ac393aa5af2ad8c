"""Stage to stage: a partition pod's FORWARDs to the next stage of its group, and the
checks of a FORWARD a stage receives.

A step's micro-batches are sent one after the other without waiting (send), so the next
stage works on one while this one computes the next; their answers come back in order
(answer). A step's PUSH part is answered twice: first with its gradient, so that this
stage computes its backward while the stages after it HOLD theirs, then with the worst
status of those HOLDs (held).

A FORWARD is not resent: a step whose downstream pod vanished is abandoned (its group
breaks and nothing of the step is applied), so the link watches its connection and gives
up as soon as it breaks, rather than after a timeout. While it waits, the pod keeps its
group's lease at the rendezvous (heartbeat), which also tells it when the group broke
elsewhere.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.algorithms.pipeline.ops import FORWARD, PREFETCH, PUSH, Backward, Forward, Held
from distbelief.runtime.transport import interface
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Header, Message, Status

FORWARD_GIVE_UP_SECONDS = 120.0
WAIT_SLICE_SECONDS = 0.5


@dataclasses.dataclass(frozen=True)
class Downstream:
    """What came back from the stages after this one."""

    status: int             # OK, STALE (a stage's shard found the step too stale), FULL (one had
                            # no room to hold it) or DONE
    loss: float = 0.0
    grad: np.ndarray | None = None   # d(loss)/d(the activations sent)


class Neighbour:
    def __init__(self, tp: interface.Transport, address: str, *, security: dict | None, layout: int,
                 worker_id: int, heartbeat: Callable[[], None]) -> None:
        self._transport, self.address, self.layout, self.worker_id = tp, address, layout, worker_id
        self._heartbeat = heartbeat
        self._link = tp.link(address, security, watch=True)
        self._seq = 0
        self._in_flight: collections.deque[tuple[int, tuple[int, int], bool]] = collections.deque()  # (seq, shape, push)
        self._holding: int | None = None  # the seq of the PUSH part whose HOLD status is still to come
        self.bytes_in = self.bytes_out = 0

    def notify(self, group: int, token: int) -> None:
        """PREFETCH: the next stage starts pulling for the step `token` now (not answered)."""
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        header = Header(op=PREFETCH.code, shard=0, layout=self.layout, seq=self._seq, worker=self.worker_id)
        self._send([header.pack(), Held(group, token).pack()])

    def send(self, group: int, token: int, activations: np.ndarray, labels: np.ndarray, *, flags: int,
             part: int = 0, parts: int = 1, step_rows: int | None = None) -> None:
        """FORWARD micro-batch `part` of `parts` of the step (of step_rows rows; these rows alone by default)."""
        rows, width = activations.shape
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        body = np.empty(rows * width + rows, dtype=np.float32)
        body[:rows * width] = activations.ravel()
        body[rows * width:] = labels
        header = Header(op=FORWARD.code, shard=0, layout=self.layout, seq=self._seq, worker=self.worker_id,
                        count=body.size)
        meta = Forward(group, token, rows, width, flags, part, parts, step_rows or rows)
        self._send([header.pack(), meta.pack(), memoryview(body)])
        self._in_flight.append((self._seq, (rows, width), bool(flags & PUSH)))

    def answer(self) -> Downstream:
        """The gradient answering the oldest FORWARD not answered yet."""
        if not self._in_flight:
            raise RuntimeError("no FORWARD is waiting for its answer")
        seq, shape, push = self._in_flight[0]
        answer = self._answer(seq, shape)
        self._in_flight.popleft()
        if push and answer.status != Status.DONE:
            self._holding = seq
        return answer

    def held(self) -> int:
        """The worst HOLD status of the stages after this one for the last PUSH part answered:
        OK, STALE, FULL or DONE."""
        if self._holding is None:
            raise RuntimeError("no PUSH part is waiting for its HOLD status")
        seq, self._holding = self._holding, None
        return self._answer(seq, None).status

    def _send(self, frames: list) -> None:
        self._link.broke()  # a break before this request cost it nothing
        if not self._link.send(frames):
            raise errors.GroupBroken(f"the next stage at {self.address} is not taking requests")
        self.bytes_out += interface.frames_nbytes(frames)

    def _answer(self, seq: int, shape: tuple[int, int] | None) -> Downstream:
        deadline = time.monotonic() + FORWARD_GIVE_UP_SECONDS
        while time.monotonic() < deadline:
            ready = self._transport.wait([self._link], WAIT_SLICE_SECONDS)
            if self._link.readable(ready):
                received = self._link.receive()
                self.bytes_in += received.nbytes
                answer = self._read(received, seq, shape)
                if answer is not None:
                    return answer
            elif self._link.broke(ready):
                raise errors.GroupBroken(f"the next stage at {self.address} disconnected")
            self._heartbeat()
        raise errors.GroupBroken(f"the next stage at {self.address} did not answer for {FORWARD_GIVE_UP_SECONDS:.0f} s")

    def _read(self, received: interface.Received, seq: int, shape: tuple[int, int] | None) -> Downstream | None:
        try:
            return self._parse(received, seq, shape)
        except errors.ProtocolError as exc:
            raise errors.GroupBroken(f"the next stage at {self.address} answered unreadably: {exc}") from exc

    def _parse(self, received: interface.Received, seq: int, shape: tuple[int, int] | None) -> Downstream | None:
        """The answer to FORWARD seq: its gradient for activations of `shape`, or (shape None) its HOLD status."""
        header = protocol.unpack_header(received.header)
        if header.seq != seq:
            return None  # an answer to an abandoned step
        if header.status == Status.ERROR:
            text = protocol.decode_text(received.frames[0]) if received.frames else ""
            raise errors.GroupBroken(f"the next stage at {self.address} refused the step: {text}")
        if header.status == Status.DONE:
            return Downstream(Status.DONE)
        if shape is None:
            if received.frames:
                raise errors.GroupBroken(f"the next stage at {self.address} answered with more than its HOLD status")
            return Downstream(header.status)
        if len(received.frames) != 2:
            raise errors.GroupBroken(f"the next stage at {self.address} answered without its gradient")
        loss = Backward.unpack(received.frames[0]).loss
        if header.count != shape[0] * shape[1]:
            raise errors.ProtocolError(f"a gradient of {header.count} values for activations of shape {shape}")
        return Downstream(header.status, loss, protocol.float_view(received.frames[1], header.count).reshape(shape))

    def close(self) -> None:
        self._link.close()


def read_forward(message: Message, *, group: int, width: int, classes: int,
                 layout: int) -> tuple[np.ndarray, np.ndarray]:
    """(activations, labels) of a FORWARD to this stage; ProtocolError names what is wrong."""
    meta: Forward = message.meta
    check_group(message, group=group, layout=layout)
    if meta.width != width or message.header.count != meta.values:
        raise errors.ProtocolError(f"a forward of width {meta.width} and {message.header.count} values; "
                                   f"this stage takes width {width}")
    rows = meta.rows
    activations = message.array[:rows * width].reshape(rows, width)
    raw = message.array[rows * width:]
    labels = raw.astype(np.int64)
    if not (labels == raw).all() or labels.min() < 0 or labels.max() >= classes:
        raise errors.ProtocolError(f"labels must be integers within 0..{classes - 1}")
    return activations, labels


def check_group(message: Message, *, group: int, layout: int) -> None:
    """A FORWARD's or PREFETCH's layout and group are this stage's; ProtocolError otherwise."""
    if message.header.layout != layout:
        raise errors.LayoutMismatch(f"layout mismatch: peer has {message.header.layout:016x}, this stage {layout:016x}")
    if message.meta.group != group:
        raise errors.StateConflict(f"a step of group {message.meta.group:016x}; this stage is in group {group:016x}")


def held_reply(request: Header, status: int) -> list:
    """The second answer to a PUSH part: the worst HOLD status of this stage and those after it."""
    return protocol.reply_frames(request, step=0, status=status)


def forward_reply(request: Header, status: int, loss: float = 0.0, grad: np.ndarray | None = None) -> list:
    meta = Backward(loss) if status != Status.DONE else None
    return protocol.reply_frames(request, step=0, status=status, meta=meta,
                                 array=None if grad is None else np.ascontiguousarray(grad, dtype=np.float32).ravel())
