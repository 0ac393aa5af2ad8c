"""Partition k > 0 of a partitioned replica: answers its group's FORWARDs from partition
k-1 (replica.py has the whole exchange), pulling when PREFETCH tells it a step will fetch.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent import futures

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.algorithms.pipeline import neighbour
from distbelief.runtime.algorithms.pipeline.ops import FETCH, FORWARD, PREFETCH, PUSH, Forward
from distbelief.runtime.algorithms.pipeline.replica import PartitionPod, PodLinks, PodSettings, worst
from distbelief.runtime.model.stages import Stage
from distbelief.runtime.observe.metrics import WorkerMetrics
from distbelief.runtime.transport import interface
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Message, Status

log = logging.getLogger(__name__)

SERVE_POLL_SECONDS = 0.5


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """A FORWARD a stage computed and passed on, waiting for its gradient to come back."""

    peer: bytes
    header: protocol.Header
    meta: Forward
    activations: list[np.ndarray]
    labels: np.ndarray


class LaterPartition(PartitionPod):
    """Partition k > 0: answers its group's FORWARDs from partition k-1."""

    def __init__(self, settings: PodSettings, stage: Stage, links: PodLinks, metrics: WorkerMetrics,
                 server: interface.Server, *, stop: threading.Event) -> None:
        super().__init__(settings, stage, links, metrics, stop=stop)
        self.server = server
        self._puller = futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self._prefetch: tuple[int, futures.Future[bool]] | None = None  # (the step's token, its pull)
        self._pending: list[MicroBatch] = []             # passed on, not answered yet
        self._next_part: tuple[int, int] | None = None   # (token, part) of the step's next FORWARD; None between steps

    def close(self) -> None:
        super().close()
        self._puller.shutdown(wait=True)
        self.server.close()

    def train(self) -> bool:
        self._pending, self._next_part = [], None  # a broken group's step is over
        try:
            return self._serve()
        finally:  # the group is over: its pull in flight, if any, ends before the next group's
            if self._prefetch is not None:
                futures.wait([self._prefetch[1]])
                self._prefetch = None

    def _serve(self) -> bool:
        if self.pull():  # whatever the group's first FORWARD says, this pod computes from its shards' state
            return True
        while not self.stop_requested.is_set():
            if self.server.poll(SERVE_POLL_SECONDS):
                incoming = self.server.receive()
                if incoming is not None and self._answer(incoming):
                    return True
            self.heartbeat()
        return False

    def _start_prefetch(self, message: Message) -> None:
        """Pass PREFETCH on, and pull for the step it names on the puller thread meanwhile
        (between steps only: during one, the shards are the step's, for its HOLD)."""
        neighbour.check_group(message, group=self.group, layout=self.links.own.layout.hash)
        if self._next_part is not None:
            raise errors.StateConflict(f"PREFETCH while step token {self._next_part[0]:016x} waits for its "
                                       f"micro-batch {self._next_part[1]}")
        token = message.meta.token
        if self._downstream is not None:
            self._downstream.notify(self.group, token)
        self._take_prefetch()  # one pull at a time into self.params
        self._prefetch = (token, self._puller.submit(self.pull))

    def _take_prefetch(self) -> tuple[int, bool] | None:
        """Wait for the pull in flight, if any: (its step's token, whether the job is done)."""
        if self._prefetch is None:
            return None
        (token, pull), self._prefetch = self._prefetch, None
        return token, pull.result()

    def _fetch(self, token: int, flags: int) -> bool:
        """Before a step uses the parameters or the shards, the pull in flight ends; a FETCH
        step that it was not for pulls now. True if the job is done."""
        prefetched = self._take_prefetch()
        if prefetched is not None and (prefetched[0] == token or prefetched[1]):
            return prefetched[1]
        return bool(flags & FETCH) and self.pull()

    def _answer(self, incoming: interface.Incoming) -> bool:
        """Take one FORWARD or PREFETCH; True when the job is done."""
        self.metrics.bytes_in.inc(incoming.nbytes)
        try:
            if not incoming.frames:
                raise errors.ProtocolError("an empty message")
            header = protocol.unpack_header(incoming.frames[0])
        except errors.ProtocolError as exc:  # no header to address an answer to: dropped
            log.warning("event=rejected role=stage partition=%d reason=%r", self.stage.index, str(exc))
            return False
        try:
            message = protocol.parse_request(incoming.frames, header)
            if message.spec is PREFETCH:
                self._start_prefetch(message)
                return False
            x, labels = self._read(message)
        except errors.ProtocolError as exc:
            log.warning("event=rejected role=stage partition=%d reason=%r", self.stage.index, str(exc))
            self._send(incoming.peer, protocol.error_frames(header, protocol.error_code(exc), str(exc)))
            return False
        return self._take(incoming.peer, message, x, labels)

    def _read(self, message: Message) -> tuple[np.ndarray, np.ndarray]:
        """A FORWARD's (activations, labels), checked; ProtocolError names what is wrong."""
        if message.spec is not FORWARD:
            raise errors.NotServed(f"a stage serves FORWARD and PREFETCH only, not {message.spec.name}")
        x, labels = neighbour.read_forward(message, group=self.group, width=self.stage.input_width,
                                           classes=self.settings.classes, layout=self.links.own.layout.hash)
        self._follow(message.meta)
        return x, labels

    def _follow(self, meta: Forward) -> None:
        """A step's micro-batches come in order, and a step starts only after the last one's last."""
        if meta.part == 0 and self._next_part is not None:
            raise errors.StateConflict(f"a new step while step token {self._next_part[0]:016x} waits for its "
                                       f"micro-batch {self._next_part[1]}")
        if meta.part > 0 and self._next_part != (meta.token, meta.part):
            raise errors.StateConflict(f"micro-batch {meta.part} of step token {meta.token:016x} out of order")
        self._next_part = None if meta.last else (meta.token, meta.part + 1)

    def _take(self, peer: bytes, message: Message, x: np.ndarray, labels: np.ndarray) -> bool:
        """Forward one micro-batch and pass it on; once the step's last one is passed on (at
        once in the last stage), answer each as its gradient comes back. True when the job is done."""
        meta: Forward = message.meta
        if meta.part == 0 and self._fetch(meta.token, meta.flags):
            self._send(peer, neighbour.forward_reply(message.header, Status.DONE))
            return True
        activations = self.stage.forward(self.params, x)
        if self._downstream is not None:
            self._downstream.send(self.group, meta.token, activations[-1], labels, flags=meta.flags, part=meta.part,
                                  parts=meta.parts, step_rows=meta.step_rows)
        self._pending.append(MicroBatch(peer, message.header, meta, activations, labels))
        if self._downstream is None or meta.last:
            return self._answer_pending()
        return False

    def _answer_pending(self) -> bool:
        """Backward through the micro-batches passed on, in order, answering each as it is
        done; after a PUSH part's gradient, its HOLD status. True when the job is done."""
        pending, self._pending = self._pending, []
        for micro in pending:
            status, loss, grad = self._backward(micro)
            self._send(micro.peer, neighbour.forward_reply(micro.header, status, loss, grad))
            if status == Status.DONE:
                return True
        last = pending[-1]
        if not last.meta.flags & PUSH:
            return False
        held = self.hold(last.meta.token)  # while the stages before this one compute their backward
        if self._downstream is not None:
            held = worst([held, self._downstream.held()])
        self._send(last.peer, neighbour.held_reply(last.header, held))
        return held == Status.DONE

    def _backward(self, micro: MicroBatch) -> tuple[int, float, np.ndarray | None]:
        meta = micro.meta
        if self._downstream is None:
            downstream_loss, upstream = 0.0, micro.labels
        else:
            answer = self._downstream.answer()
            if answer.status == Status.DONE:
                return Status.DONE, 0.0, None
            downstream_loss, upstream = answer.loss, answer.grad
        loss, input_grad = self.compute(micro.activations, upstream, share=meta.share, last=meta.last)
        return Status.OK, loss + downstream_loss, input_grad

    def _send(self, peer: bytes, frames: list) -> None:
        if self.server.send(peer, frames):
            self.metrics.bytes_out.inc(interface.frames_nbytes(frames))
