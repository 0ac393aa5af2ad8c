"""The core of one parameter shard: serving, admission, resends, completion, checkpoints.

The core serves requests one at a time (an update is never half-applied when a pull or
a checkpoint reads the state) and knows nothing of any algorithm. What a shard holds and
which ops it answers come from its plugins (ShardPlugin): the dense slice with its
optimizer (params/dense.py), Sandblaster's vectors, and whatever an algorithm adds. The core:

- parses and checks every request against its op's spec (protocol.parse_request); a
  malformed one gets an error reply, or is dropped, and the shard keeps serving;
- answers HELLO (the layout check; admission is the update hooks'), STATS and DONE;
- answers a resent command (same peer, worker and seq) with its first reply, so an
  update is applied once however often the reply was lost;
- writes atomic checkpoints of the plugins' state and each peer's last command (a restarted shard
  answers resends), on an interval and at the end; a failed write is logged and tried again later.

Plugins (plugin.py) see the core through its members: index, layout, step, finished, metrics,
command_time, settings.checkpoint_dir, applied(), count_examples(), checkpoint_now(), load().
An algorithm's update hooks (plugin.UpdateHook, watch_updates) are asked at HELLO whether a
replica may train now, told of every update applied, and add their figures to STATS and to
the chief's record (Downpour's: warm-start, staleness, the replicas' loss).

With backups, the role hands the core its copies (serve_copies, copies/replication.py): only
the primary copy serves clients, and every command it applies is forwarded to its backups;
the replies wait in the outbox, in order, until the copies say every backup in sync has
what they answer (the serving thread goes on meanwhile). The copies' own ops are raw_ops,
answered at once; the core knows them only through plugin.Replication.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from distbelief.runtime import errors, keys
from distbelief.runtime.observe.metrics import RateWindow, ShardMetrics
from distbelief.runtime.shard import checkpoint, losses
from distbelief.runtime.shard.plugin import (
    Answer, Handler, RawHandler, Replication, ShardPlugin, SingleCopy, UpdateHook)
from distbelief.runtime.shard.resends import CHECKPOINT_KEY, LastCommands, repeat_of
from distbelief.runtime.shard.saves import CheckpointSchedule
from distbelief.runtime.transport import interface, zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.protocol import Header, Message, Status

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
RATE_WINDOW_SECONDS = 5.0


@dataclasses.dataclass
class ShardSettings:
    shard: int
    bind: str
    checkpoint_dir: str
    checkpoint_every: float = 30.0
    checkpoint_keep: int = 3
    linger_seconds: float = 60.0   # keep answering DONE this long, then exit
    security: keys.ServerSecurity | None = None  # who is admitted, when the job has keys
    bulk_bind: str | None = None  # where AES-GCM sessions' messages come in (CurveZMQ jobs)
    job_uid: str | None = None    # the job's uid (on a cluster): recorded in, and checked against, checkpoints


class Shard:
    def __init__(self, settings: ShardSettings, layout: Layout, metrics: ShardMetrics, *,
                 transport_: interface.Transport | None = None, stop: threading.Event | None = None) -> None:
        self.settings, self.layout, self.metrics = settings, layout, metrics
        self.index = settings.shard
        self.step = 0
        self.restarts = 0
        self.start_time = time.time()
        self.finished: dict | None = None
        self.ready = threading.Event()
        self.endpoint = settings.bind  # the bound address (with the real port) once serving
        self.step_reached: Callable[[int], None] = lambda step: None
        self.examples_per_second = 0.0
        self.examples_total = 0
        self.plugins: list[ShardPlugin] = []
        self._transport = transport_ or zmq_transport.default()
        self.stopping = stop or threading.Event()
        self._handlers: dict[int, Handler] = {protocol.HELLO.code: self._hello, protocol.STATS.code: self._stats,
                                              protocol.DONE.code: self._done}
        self._repeats: dict[int, Handler] = {}
        self.raw_ops: dict[int, RawHandler] = {}  # ops reading their own frames (the copies')
        self.copies: Replication = SingleCopy()
        self.update_hooks: list[UpdateHook] = []
        self._peer: tuple = ()  # who sent the request being handled: (ZAP user, routing id)
        self.command_time = time.time()  # the primary's clock when it took this command (answer)
        self._rate = RateWindow(RATE_WINDOW_SECONDS)
        self.last_commands = LastCommands()
        self.lost = losses.LostUpdates(self.index, metrics.updates_lost)
        self.saves = CheckpointSchedule(self)
        self._outbox: collections.deque[tuple[Any, bytes, list]] = collections.deque()  # (tag, peer, reply)

    # -- plugins ---------------------------------------------------------------------------

    def attach(self, plugin: ShardPlugin) -> None:
        """Serve a plugin's ops (each op has one owner) and keep its state in checkpoints."""
        for table, ops in ((self._handlers, plugin.handlers()), (self._repeats, plugin.repeat_handlers())):
            for spec, handler in ops.items():
                if table is self._handlers and spec.code in table:
                    raise errors.ConfigError(f"op {spec.name} is served twice on shard {self.index}")
                table[spec.code] = handler
        self.plugins.append(plugin)

    def plugin(self, kind: type) -> Any:
        """The attached plugin of this class."""
        return next(p for p in self.plugins if isinstance(p, kind))

    def serve_copies(self, copies: Replication) -> None:
        """Serve as one of the shard's copies (copies/replication.py): only while this copy
        is primary, with every command forwarded to its backups, and the copies' own ops."""
        for spec, handler in copies.raw_ops().items():
            if spec.code in self._handlers or spec.code in self.raw_ops:
                raise errors.ConfigError(f"op {spec.name} is served twice on shard {self.index}")
            self.raw_ops[spec.code] = handler
        self.copies = copies

    def watch_updates(self, hook: UpdateHook) -> None:
        """Ask hook at every HELLO, tell it of every update, and report its figures."""
        self.update_hooks.append(hook)

    # -- life cycle ------------------------------------------------------------------------

    def restore(self) -> None:
        try:
            os.makedirs(self.settings.checkpoint_dir, exist_ok=True)
        except OSError as exc:
            raise errors.CheckpointError(f"cannot create checkpoint folder {self.settings.checkpoint_dir}: {exc}") from exc
        ckpt = checkpoint.restore_latest(self.settings.checkpoint_dir, layout=self.layout.hash, shard=self.index,
                                         job_uid=self.settings.job_uid, accept=self.load)
        if ckpt is None:
            log.info("event=fresh_start shard=%d", self.index)
            return
        self.take_meta(ckpt.meta)
        self.restarts = int(ckpt.meta.get("restarts", 0)) + 1
        log.info("event=restored shard=%d step=%d restarts=%d finished=%s",
                 self.index, self.step, self.restarts, bool(self.finished))

    def load(self, ckpt: checkpoint.Checkpoint) -> None:
        """Take the training state of a checkpoint (at start, or a Sandblaster rollback)."""
        for plugin in self.plugins:
            plugin.restore(ckpt)
        self.lost.new_life(ckpt.step)
        self.step = ckpt.step
        self.saves.taken(self.step)
        self.metrics.global_step.set(self.step)

    def take_meta(self, meta: dict) -> None:
        """The core's figures beside a state: start time, examples, the job's end, each peer's last command."""
        self.start_time = float(meta.get("startTime", self.start_time))
        self.finished, self.examples_total = meta.get("finished"), int(meta.get("examples", 0))
        self.last_commands.load(meta.get(CHECKPOINT_KEY, []))
        self.lost.restore(int(meta.get(losses.KEY, 0)))

    def stop(self) -> None:
        self.stopping.set()

    def serve(self) -> None:
        """Answer requests until the job is done and the linger has passed, or stop()."""
        server = self._bind()
        self.metrics.restarts.set(self.restarts)
        self.metrics.global_step.set(self.step)
        self.ready.set()
        try:
            while not self.stopping.is_set() and not self._lingered():
                links = self.copies.links()
                if self.copies.accepting():
                    if server.poll(POLL_SECONDS, links):
                        self._handle(server)
                elif links:
                    self._transport.wait(links, POLL_SECONDS)
                self.copies.tick()
                self._flush(server)
                self.saves.maybe()
        finally:
            server.close()
            self.copies.close()
            self.checkpoint_now()

    def _bind(self) -> interface.Server:
        longest = max([0, *(p.array_values() for p in self.plugins)])
        max_frame = max(protocol.max_frame_bytes(longest), self.copies.frame_bytes)
        server = self._transport.server(self.settings.bind, who=f"shard {self.index}",
                                        max_frame=max_frame, max_frames=3 + self.copies.extra_frames,
                                        security=self.settings.security, bulk=self.settings.bulk_bind)
        self.endpoint = server.endpoint
        log.info("event=listening shard=%d address=%s step=%d auth=%s", self.index, self.endpoint, self.step,
                 self.settings.security.mechanism if self.settings.security else "none")
        return server

    def _lingered(self) -> bool:
        return self.finished is not None and time.time() - float(self.finished["at"]) >= self.settings.linger_seconds

    # -- requests --------------------------------------------------------------------------

    def _handle(self, server: interface.Server) -> None:
        incoming = server.receive()
        if incoming is None:
            self._reject("dropped a message with too many frames")
            return
        self.metrics.bytes_in.inc(incoming.nbytes)
        if not incoming.frames:
            self._reject("dropped an empty message")
            return
        old = protocol.old_version_refusal(incoming.frames[0])
        if old is not None:
            self._reject("a peer of protocol version 1")
            self._send(server, incoming.peer, [old, protocol.version_refusal_text()])
            return
        try:
            header = protocol.unpack_header(incoming.frames[0])
        except errors.ProtocolError as exc:
            self._reject(f"dropped a message: {exc}")
            return
        started = time.perf_counter()
        reply = self.answer(header, incoming)
        tag = None if header.op in self.raw_ops else self.copies.reply_tag()
        if header.op in self.raw_ops or (tag is None and not self._outbox):  # the copies' own: at once
            self._send(server, incoming.peer, reply)
        else:
            self._outbox.append((tag, incoming.peer, reply))
        self.metrics.request_seconds(protocol.spec_of(header.op).name).observe(time.perf_counter() - started)

    def _flush(self, server: interface.Server) -> None:
        """Send the replies the copies released, in the order they were given; drop those of a
        term this copy no longer serves (their clients ask the new primary)."""
        while self._outbox:
            tag, peer, reply = self._outbox[0]
            verdict = True if tag is None else self.copies.released(tag)
            if verdict is False:
                return
            self._outbox.popleft()
            if verdict:
                self._send(server, peer, reply)

    def answer(self, header: Header, incoming: interface.Incoming, *, taken_at: float | None = None) -> list:
        """The reply to one request from incoming.peer. A backup also answers the requests its
        primary forwards, as if their first sender had sent them when the primary took them
        (taken_at): what a plugin decides by time, every copy decides alike."""
        self.command_time = time.time() if taken_at is None else taken_at
        try:
            self._check(header, incoming.user)
            if header.op in self.raw_ops:
                return self.raw_ops[header.op](header, incoming)
            message = protocol.parse_request(incoming.frames, header)
            peer = self._peer = (incoming.user, incoming.peer)
            reply = self._repeated(peer, message)
            if reply is None:
                reply = self._dispatch(message, self._handlers[header.op])
                if message.spec.command:
                    self.copies.replicate(incoming)  # its reply waits until every copy in sync applied it
                self._remember(peer, message, reply)
            return reply
        except errors.NotPrimary as exc:  # a backup: not a bad message, the client tries the next copy
            return protocol.error_frames(header, protocol.error_code(exc), str(exc), step=self.step)
        except errors.ProtocolError as exc:
            self._reject(str(exc))
            return protocol.error_frames(header, protocol.error_code(exc), str(exc), step=self.step)

    def _dispatch(self, message: Message, handler: Handler) -> list:
        if self.finished is not None and message.spec is not protocol.STATS:
            return protocol.reply_frames(message.header, step=self.step, status=Status.DONE)
        answer = handler(message)
        return protocol.reply_frames(message.header, step=self.step, status=answer.status, meta=answer.meta,
                                     array=answer.array)

    def _check(self, header: Header, user: str | None) -> None:
        if header.shard != self.index:
            raise errors.WrongShard(f"message addressed to shard {header.shard}, this is shard {self.index}")
        if header.layout != self.layout.hash:
            raise errors.LayoutMismatch(
                f"layout mismatch: peer has {header.layout:016x}, shard {self.index} has "
                f"{self.layout.hash:016x} (another model or shard count)")
        spec = protocol.spec_of(header.op)
        if header.op not in self._handlers and header.op not in self.raw_ops:
            raise errors.NotServed(f"op {spec.name} is not served by this job's algorithm")
        if header.op not in self.raw_ops:
            self.copies.check_serving(spec)
        security = self.settings.security
        if spec.privileged and security is not None and not security.is_chief(user):
            raise errors.Forbidden(f"op {spec.name} is the chief's to send; refused from another key")

    def _repeated(self, peer: tuple, message: Message) -> list | None:
        """The reply to a command this peer sent before, if this is that command again."""
        record = repeat_of(self.last_commands, peer, message.header) if message.spec.command else None
        if record is None:
            return None
        log.info("event=command_repeated shard=%d worker=%08x op=%s action=first_reply_again",
                 self.index, message.header.worker, message.spec.name)
        return record[2] if record[2] is not None else self._dispatch(message, self._repeats[message.header.op])

    def _remember(self, peer: tuple, message: Message, reply: list) -> None:
        if not message.spec.command:
            return
        # A reply holding a parameter copy is not kept; a repeat gets a fresh one instead.
        kept = None if message.header.op in self._repeats and self.finished is None else reply
        self.last_commands.remember(peer, message.header.seq, message.header.op, kept)

    def _reject(self, reason: str) -> None:
        self.metrics.rejected.inc()
        log.warning("event=rejected shard=%d reason=%r", self.index, reason)

    def _send(self, server: interface.Server, peer: bytes, reply: list) -> None:
        if not server.send(peer, reply):
            log.warning("event=reply_dropped shard=%d reason=peer_queue_full", self.index)
            return
        self.metrics.bytes_out.inc(interface.frames_nbytes(reply))

    # -- the core's ops --------------------------------------------------------------------

    def _hello(self, message: Message) -> Answer:
        size = sum(p.array_values() for p in self.plugins)
        admitted = all(hook.admit(self._peer) for hook in self.update_hooks)
        return Answer(meta=protocol.ShardInfo(size=size), status=Status.OK if admitted else Status.WAIT)

    def _stats(self, message: Message) -> Answer:
        stats = {"shard": self.index, "step": self.step, "restarts": self.restarts, "startTime": self.start_time,
                 "finished": self.finished, losses.KEY: self.lost.total, **self._hook_figures(),
                 **self.copies.stats()}
        return Answer(meta=protocol.JsonObject(stats))

    def _done(self, message: Message) -> Answer:
        try:
            reason, outcome = (str(message.meta.value[k]) for k in ("reason", "outcome"))
        except KeyError as exc:
            raise errors.ProtocolError(f"done: no {exc}") from exc
        self.finished = {"reason": reason, "outcome": outcome, "at": time.time(), "step": self.step}
        self.metrics.done.set(1)
        log.info("event=job_finished shard=%d step=%d reason=%r outcome=%r", self.index, self.step, reason, outcome)
        self.checkpoint_now()
        return Answer(status=Status.DONE)

    # -- what plugins report -----------------------------------------------------------------

    def applied(self, header: Header, *, examples: int, loss: float) -> None:
        """One update applied (header: its request's; examples and their mean loss behind it):
        the update hooks are told first, while the step is still the one before it; then the
        step advances and the examples are counted. A push pulled at a step this shard has
        not reached tells of updates it lost (losses.py)."""
        if header.step > self.step and self.copies.serves_clients():
            self.lost.seen(header.step, self.step)
        for hook in self.update_hooks:
            hook.applied(self._peer, header, examples=examples, loss=loss)
        self.step += 1
        self.metrics.global_step.set(self.step)
        self.count_examples(examples)
        self.step_reached(self.step)

    def training_figures(self) -> dict[str, Any]:
        """Examples so far and per second, and the update hooks' figures (Downpour's: the
        replicas' mean minibatch loss, how many pushed lately), for the chief's history."""
        return {"examples": self.examples_total, "examplesPerSecond": self.examples_per_second,
                **self._hook_figures()}

    def _hook_figures(self) -> dict[str, Any]:
        figures: dict[str, Any] = {}
        for hook in self.update_hooks:
            figures.update(hook.figures())
        return figures

    def count_examples(self, examples: int) -> None:
        """Examples trained on, for the totals and the examples/s rate."""
        self.metrics.examples.inc(examples)
        self.examples_total += examples
        rate = self._rate.add(examples)
        if rate is not None:
            self.examples_per_second = rate
            self.metrics.examples_per_second.set(rate)

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint_now(self) -> None:
        """Write a checkpoint of the current state if it differs from the last one."""
        self.saves.now()

    def core_meta(self) -> dict[str, Any]:
        """The core's figures saved beside its state (take_meta reads them back)."""
        meta = {"restarts": self.restarts, "startTime": self.start_time, "finished": self.finished,
                "examples": self.examples_total, losses.KEY: self.lost.total}
        return {**meta, checkpoint.JOB_UID: self.settings.job_uid} if self.settings.job_uid else meta

    def snapshot(self, *, transfer: bool = False) -> checkpoint.Checkpoint:
        """The state for the next checkpoint (the arrays are the live ones, not copies); with
        transfer, the whole state in memory, for a copy catching up (no row files named)."""
        meta = {**self.core_meta(), CHECKPOINT_KEY: self.last_commands.export()}
        arrays: dict[str, np.ndarray] = {}
        for plugin in self.plugins:  # a plugin may write files of its own (the sparse rows'), unless transfer
            plugin_arrays, plugin_meta = plugin.checkpoint_state(transfer=transfer)
            arrays.update(plugin_arrays)
            meta.update(plugin_meta)
        return checkpoint.Checkpoint(step=self.step, layout=self.layout.hash, shard=self.index, arrays=arrays, meta=meta)
