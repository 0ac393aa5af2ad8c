"""One parameter shard: owns a contiguous slice of the parameters, applies pushed
gradients, serves pulls, checkpoints, and stops cleanly when the job is done.

The serving loop is single-threaded: every request is handled to completion before the
next, so an update is never half-applied when a pull or a checkpoint reads the slice.
Requests are dispatched through an op table; every header field is checked first, and a
message that fails a check gets an error reply (or, if it cannot even be parsed, is
dropped) while the shard keeps serving.

With the job's keys (ShardSettings.security), a ZAP handler admits only peers that hold
them (distbelief.runtime.keys: CurveZMQ, or PLAIN when the job turns encryption off);
other peers never get past the handshake. A command (a push, a Sandblaster vector op)
sent again with the seq of the peer's last one, because its reply was lost, gets the
first reply again and is not applied twice. A checkpoint that cannot be written (disk
full, folder gone) is logged as event=checkpoint_failed and tried again at the next
interval; training goes on from memory and the checkpoints already written stay as
they were.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from typing import Callable, Protocol

import numpy as np
import zmq

from distbelief.runtime import checkpoint, errors, keys, protocol
from distbelief.runtime.layout import Layout
from distbelief.runtime.metrics import ShardMetrics
from distbelief.runtime.optim import make_optimizer
from distbelief.runtime.protocol import Header, Op, Status

log = logging.getLogger(__name__)

POLL_MS = 100
WARMSTART_LEASE_SECONDS = 10.0
RATE_WINDOW_SECONDS = 5.0
LOSS_EMA = 0.05
REMEMBERED_PEERS = 4096  # peers (replicas, the coordinator) whose last command a shard remembers
# Requests that change the shard's state. A peer resends one when the reply was lost (a
# reconnect, a timeout); the repeat, with the same worker, seq and op, gets the first
# reply again and does not act twice (an AXPY or a push applied twice is silently wrong).
COMMANDS = frozenset({Op.PUSH, Op.PUSH_PULL, Op.DONE, Op.BEGIN_EVAL, Op.ACCUMULATE, Op.VECTOR, Op.COMMIT,
                      Op.ROLLBACK})

Handler = Callable[[Header, list], list]


class Extension(Protocol):
    """State an algorithm keeps on the shard beside its parameters (Sandblaster's vectors),
    saved in and restored from the shard's checkpoints."""

    def arrays(self) -> dict[str, np.ndarray]: ...

    def meta(self) -> dict: ...

    def restore(self, ckpt: checkpoint.Checkpoint) -> None: ...


@dataclasses.dataclass
class ShardSettings:
    shard: int
    bind: str
    checkpoint_dir: str
    checkpoint_every: float = 30.0
    checkpoint_keep: int = 3
    learning_rate: float = 0.1
    optimizer: str = "adagrad"
    warmstart_steps: int = 0
    linger_seconds: float = 60.0   # keep answering DONE this long, then exit
    security: keys.ServerSecurity | None = None  # who is admitted, when the job has keys


class Shard:
    def __init__(self, settings: ShardSettings, layout: Layout, initial: np.ndarray,
                 metrics: ShardMetrics, *, context: zmq.Context | None = None,
                 stop: threading.Event | None = None) -> None:
        self.settings, self.layout, self.metrics = settings, layout, metrics
        self.index = settings.shard
        first, last = layout.bounds(self.index)
        if initial.size != layout.total:
            raise errors.ConfigError(f"initial parameters have {initial.size} values, layout {layout.total}")
        self.params = np.array(initial[first:last], dtype=np.float32)
        self.optimizer = make_optimizer(settings.optimizer, self.params.size, learning_rate=settings.learning_rate)
        self.step = 0
        self.restarts = 0
        self.start_time = time.time()
        self.finished: dict | None = None
        self.ready = threading.Event()
        self.endpoint = settings.bind  # the bound address (with the real port) once serving
        self.step_reached: Callable[[int], None] = lambda step: None
        self._stop = stop or threading.Event()
        self._context = context or zmq.Context.instance()
        self._handlers: dict[int, Handler] = {
            Op.HELLO: self._hello, Op.PULL: self._pull, Op.PUSH: self._push, Op.PUSH_PULL: self._push_pull,
            Op.STATS: self._stats, Op.DONE: self._done,
        }
        self._warm_owner: tuple[int, float] | None = None
        self._rate_window: deque[tuple[float, int]] = deque()
        self._rate_sum = 0  # the examples in _rate_window
        self._last_command: OrderedDict[int, tuple[int, int, list | None]] = OrderedDict()  # worker -> seq, op, reply
        self._last_checkpoint = (time.monotonic(), -1)
        self._train_loss: float | None = None
        self.examples_per_second = 0.0
        self.examples_total = 0
        self._saved_finished = False
        self._admission: keys.Admission | None = None
        self._checkpoint_failures = 0  # in a row; reset by the next checkpoint that lands
        self.extension: Extension | None = None

    # -- life cycle ------------------------------------------------------------------

    def register(self, op: int, handler: Handler | None) -> None:
        """Add an op (the coordinator's vector ops extend the table this way), or with
        None take one away (a Sandblaster shard applies no Downpour pushes)."""
        if handler is None:
            self._handlers.pop(op, None)
        else:
            self._handlers[op] = handler

    def restore(self) -> None:
        try:
            os.makedirs(self.settings.checkpoint_dir, exist_ok=True)
        except OSError as exc:
            raise errors.CheckpointError(f"cannot create checkpoint folder {self.settings.checkpoint_dir}: {exc}") from exc
        ckpt = checkpoint.restore_latest(self.settings.checkpoint_dir, layout=self.layout.hash, shard=self.index)
        if ckpt is None:
            log.info("event=fresh_start shard=%d params=%d", self.index, self.params.size)
            return
        self._check_optimizer(ckpt)
        self.load(ckpt)
        self.restarts = int(ckpt.meta.get("restarts", 0)) + 1
        self.start_time = float(ckpt.meta.get("startTime", self.start_time))
        self.finished = ckpt.meta.get("finished")
        self.examples_total = int(ckpt.meta.get("examples", 0))
        log.info("event=restored shard=%d step=%d restarts=%d finished=%s",
                 self.index, self.step, self.restarts, bool(self.finished))

    def _check_optimizer(self, ckpt: checkpoint.Checkpoint) -> None:
        # Another rule's state would be read as this one's (or be missing): refuse, and
        # leave the checkpoints as they are for the user to resume with their optimizer.
        written_by = ckpt.meta.get("optimizer", self.optimizer.name)
        if written_by != self.optimizer.name:
            raise errors.ConfigError(
                f"shard {self.index}: the checkpoints in {self.settings.checkpoint_dir} were written with "
                f"optimizer {written_by!r}, but the job now asks for {self.optimizer.name!r}; resume with "
                f"spec.training.optimizer: {written_by}, or train afresh in another output folder")

    def load(self, ckpt: checkpoint.Checkpoint) -> None:
        """Take the training state of a checkpoint (at start, or a Sandblaster rollback)."""
        self.params[...] = ckpt.arrays["params"]
        own = self.optimizer.state()
        self.optimizer.load_state({k: v for k, v in ckpt.arrays.items() if k in own})
        if self.extension is not None:
            self.extension.restore(ckpt)
        self.step = ckpt.step
        self._last_checkpoint = (time.monotonic(), self.step)
        self.metrics.checkpoint_step.set(self.step)
        self.metrics.global_step.set(self.step)

    def stop(self) -> None:
        self._stop.set()

    def serve(self) -> None:
        """Answer requests until the job is done and the linger has passed, or stop()."""
        socket = self._bind()
        self.metrics.restarts.set(self.restarts)
        self.metrics.global_step.set(self.step)
        self.ready.set()
        try:
            while not self._stop.is_set() and not self._lingered():
                if socket.poll(POLL_MS):
                    self._handle(socket)
                self._maybe_checkpoint()
        finally:
            socket.close(linger=1000)
            if self._admission is not None:
                self._admission.close()
                self._admission = None
            self.checkpoint_now()

    def _bind(self) -> zmq.Socket:
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.MAXMSGSIZE, protocol.max_message_bytes(self.params.size))
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._admission = keys.bind_server(
            self._context, socket, self.settings.bind, who=f"shard {self.index}",
            domain=f"distbelief-shard-{self.index}-{id(self):x}", security=self.settings.security)
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("event=listening shard=%d address=%s step=%d auth=%s", self.index, self.endpoint, self.step,
                 self.settings.security.mechanism if self.settings.security else "none")
        return socket

    def _lingered(self) -> bool:
        if self.finished is None:
            return False
        return time.time() - float(self.finished["at"]) >= self.settings.linger_seconds

    # -- requests --------------------------------------------------------------------

    def _handle(self, socket: zmq.Socket) -> None:
        frames = socket.recv_multipart(copy=False)
        self.metrics.bytes_in.inc(sum(len(f.buffer) for f in frames))
        identity, body = frames[0].bytes, frames[1:]
        try:
            header = protocol.unpack_header(body[0].buffer) if body else None
        except errors.ProtocolError as exc:
            self._reject(f"dropped a message: {exc}")
            return
        if header is None:
            self._reject("dropped an empty message")
            return
        started = time.perf_counter()
        try:
            self._check(header, body)
            reply = self._repeated(header)
            if reply is None:
                reply = self._handlers[header.op](header, body[1:])
                self._remember(header, reply)
        except errors.ProtocolError as exc:
            self._reject(str(exc))
            reply = [header.reply(status=Status.ERROR, step=self.step).pack(), str(exc).encode()]
        self._send(socket, identity, reply)
        self.metrics.handle_seconds[Op(header.op)].observe(time.perf_counter() - started)

    def _check(self, header: Header, body: list) -> None:
        if header.shard != self.index:
            raise errors.ProtocolError(f"message addressed to shard {header.shard}, this is shard {self.index}")
        if header.layout != self.layout.hash:
            raise errors.LayoutMismatch(
                f"layout mismatch: peer has {header.layout:016x}, shard {self.index} has "
                f"{self.layout.hash:016x} (another model or shard count)")
        if header.op not in self._handlers:
            raise errors.ProtocolError(f"op {header.op} is not served here")
        if len(body) > 2:
            raise errors.ProtocolError(f"{len(body)} frames, at most 2 expected")

    def _repeated(self, header: Header) -> list | None:
        """The reply to a command this peer sent before, if this is that command again."""
        if header.op not in COMMANDS:
            return None
        seq, op, reply = self._last_command.get(header.worker, (None, None, None))
        if (seq, op) != (header.seq, header.op):
            return None
        log.info("event=command_repeated shard=%d worker=%08x op=%s action=first_reply_again",
                 self.index, header.worker, Op(op).name)
        if reply is not None:
            return reply
        return self._finished_reply(header) or self._snapshot(header)  # a PUSH_PULL: today's parameters

    def _remember(self, header: Header, reply: list) -> None:
        if header.op not in COMMANDS:
            return
        # A PUSH_PULL reply holds a parameter copy; a repeat gets a fresh one instead.
        kept = None if header.op == Op.PUSH_PULL and self.finished is None else reply
        self._last_command[header.worker] = (header.seq, header.op, kept)
        self._last_command.move_to_end(header.worker)
        if len(self._last_command) > REMEMBERED_PEERS:
            self._last_command.popitem(last=False)  # the peer heard from least recently

    def _reject(self, reason: str) -> None:
        self.metrics.rejected.inc()
        log.warning("event=rejected shard=%d reason=%r", self.index, reason)

    def _send(self, socket: zmq.Socket, identity: bytes, reply: list) -> None:
        try:
            socket.send_multipart([identity, *reply], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("event=reply_dropped shard=%d reason=peer_queue_full", self.index)
            return
        self.metrics.bytes_out.inc(sum(len(r) if isinstance(r, bytes) else r.nbytes for r in reply))

    def _finished_reply(self, header: Header) -> list | None:
        if self.finished is None:
            return None
        return [header.reply(status=Status.DONE, step=self.step).pack(), json.dumps(self.finished).encode()]

    def _hello(self, header: Header, payload: list) -> list:
        finished = self._finished_reply(header)
        if finished:
            return finished
        status = Status.OK if self._admit_warmstart(header.worker) else Status.WAIT
        return [header.reply(status=status, step=self.step, count=self.params.size).pack()]

    def _admit_warmstart(self, worker: int) -> bool:
        """Shard 0 lets one replica train alone until warmstartSteps updates are applied."""
        if self.index != 0 or self.step >= self.settings.warmstart_steps:
            return True
        now = time.monotonic()
        if self._warm_owner and self._warm_owner[0] != worker and now - self._warm_owner[1] < WARMSTART_LEASE_SECONDS:
            return False
        self._warm_owner = (worker, now)
        return True

    def _pull(self, header: Header, payload: list) -> list:
        if payload:
            raise errors.ProtocolError("a pull carries no payload")
        finished = self._finished_reply(header)
        if finished:
            return finished
        return self._snapshot(header)

    def _snapshot(self, header: Header) -> list:
        # ZeroMQ sends after the handler returns, while the next push may already update
        # the slice in place: send a copy, so a pull is one consistent step.
        return [header.reply(step=self.step, count=self.params.size).pack(), memoryview(self.params.copy())]

    def _push(self, header: Header, payload: list) -> list:
        finished = self._finished_reply(header)
        if finished:
            return finished
        if len(payload) != 1 or header.count != self.params.size:
            raise errors.ProtocolError(
                f"a push to shard {self.index} must carry {self.params.size} float32 values, "
                f"header declares {header.count}")
        grad = protocol.float_view(payload[0].buffer, header.count)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is what we test for
            finite = np.isfinite(np.dot(grad, grad))
        if not finite:
            raise errors.ProtocolError("gradient has non-finite values; update refused")
        self.optimizer.apply(self.params, grad)
        self._count_update(header)
        return [header.reply(step=self.step).pack()]

    def _push_pull(self, header: Header, payload: list) -> list:
        reply = self._push(header, payload)
        return reply if self.finished is not None else self._snapshot(header)

    def _count_update(self, header: Header) -> None:
        staleness = self.step - header.step if header.step <= self.step else 0
        self.step += 1
        if self._warm_owner and self._warm_owner[0] == header.worker:
            self._warm_owner = (header.worker, time.monotonic())
        self.metrics.global_step.set(self.step)
        self.metrics.staleness.observe(staleness)
        self.count_examples(header.examples)
        self._train_loss = header.loss if self._train_loss is None else (
            (1 - LOSS_EMA) * self._train_loss + LOSS_EMA * header.loss)
        self.metrics.train_loss.set(self._train_loss)
        self.step_reached(self.step)

    def count_examples(self, examples: int) -> None:
        """Examples trained on, for the totals and the examples/s rate."""
        self.metrics.examples.inc(examples)
        self.examples_total += examples
        now = time.monotonic()
        self._rate_window.append((now, examples))
        self._rate_sum += examples
        while self._rate_window and now - self._rate_window[0][0] > RATE_WINDOW_SECONDS:
            self._rate_sum -= self._rate_window.popleft()[1]
        span = now - self._rate_window[0][0]
        if span > 0.5:
            self.examples_per_second = self._rate_sum / span
            self.metrics.examples_per_second.set(self.examples_per_second)

    def _stats(self, header: Header, payload: list) -> list:
        stats = {"shard": self.index, "step": self.step, "size": int(self.params.size),
                 "restarts": self.restarts, "startTime": self.start_time, "finished": self.finished,
                 "trainLoss": self._train_loss}
        return [header.reply(step=self.step).pack(), json.dumps(stats).encode()]

    def _done(self, header: Header, payload: list) -> list:
        if len(payload) != 1:
            raise errors.ProtocolError("done carries the reason as text")
        try:
            finished = json.loads(protocol.decode_text(payload[0].buffer))
            reason, outcome = str(finished["reason"]), str(finished["outcome"])
        except (ValueError, KeyError, TypeError) as exc:
            raise errors.ProtocolError(f"done: unreadable reason: {exc}") from exc
        if self.finished is None:
            self.finished = {"reason": reason, "outcome": outcome, "at": time.time(), "step": self.step}
            self.metrics.done.set(1)
            log.info("event=job_finished shard=%d step=%d reason=%s outcome=%s", self.index, self.step, reason, outcome)
            self.checkpoint_now()
        return [header.reply(status=Status.DONE, step=self.step).pack()]

    # -- checkpoints -----------------------------------------------------------------

    def _maybe_checkpoint(self) -> None:
        when, step = self._last_checkpoint
        if step != self.step and time.monotonic() - when >= self.settings.checkpoint_every:
            self.checkpoint_now()

    def checkpoint_now(self) -> None:
        """Write a checkpoint of the current state if it differs from the last one."""
        if self._last_checkpoint[1] == self.step and not self._finished_unsaved():
            return
        meta = {"restarts": self.restarts, "startTime": self.start_time, "finished": self.finished,
                "optimizer": self.optimizer.name, "examples": self.examples_total}
        arrays = {"params": self.params, **self.optimizer.state()}
        if self.extension is not None:
            arrays.update(self.extension.arrays())
            meta.update(self.extension.meta())
        ckpt = checkpoint.Checkpoint(step=self.step, layout=self.layout.hash, shard=self.index,
                                     arrays=arrays, meta=meta)
        try:
            path = checkpoint.save(self.settings.checkpoint_dir, ckpt, keep=self.settings.checkpoint_keep)
        except errors.CheckpointError as exc:
            # Training goes on from memory; the previous checkpoints are untouched, and the
            # next interval tries again (a full or unwritable folder may come back).
            self._checkpoint_failures += 1
            log.error("event=checkpoint_failed shard=%d step=%d folder=%s failures=%d error=%r", self.index,
                      self.step, self.settings.checkpoint_dir, self._checkpoint_failures, str(exc))
            self._last_checkpoint = (time.monotonic(), self._last_checkpoint[1])
            return
        if self._checkpoint_failures:
            log.info("event=checkpoint_resumed shard=%d step=%d after_failures=%d", self.index, self.step,
                     self._checkpoint_failures)
            self._checkpoint_failures = 0
        self._last_checkpoint = (time.monotonic(), self.step)
        self._saved_finished = self.finished is not None
        self.metrics.checkpoint_step.set(self.step)
        self.metrics.checkpoint_time.set(time.time())
        log.info("event=checkpoint shard=%d step=%d path=%s", self.index, self.step, os.path.basename(path))

    def _finished_unsaved(self) -> bool:
        return self.finished is not None and not self._saved_finished
