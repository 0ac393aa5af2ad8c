"""The Sandblaster coordinator: drives L-BFGS over the shards and hands out work units.

It runs beside shard 0, in its own thread with its own sockets: a client of every shard
(as the chief is) and a ROUTER that the replicas ask for work. It never holds a vector.
ShardSpace turns each L-BFGS operation into one command to every shard and sums the
scalars they return; an evaluation hands the batch's units to replicas until all are in.

Recovery: every command's answer carries the shard's incarnation. When one changes (a
shard restarted) or a replica reports that a shard lost its evaluation, the coordinator
asks every shard which committed iterations it holds, rolls them all back to the newest
common one, and resumes from the scalar state committed with it. A restarted coordinator
(shard 0 restarted) starts the same way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
import random
import threading
import time
from typing import Callable

from distbelief.runtime import errors, keys
from distbelief.runtime.algorithms.chiefport import ASK_POLICY
from distbelief.runtime.algorithms.sandblaster import ops
from distbelief.runtime.algorithms.sandblaster.lbfgs import Lbfgs, LbfgsSettings, LbfgsState
from distbelief.runtime.algorithms.sandblaster.ops import SandblasterShards, UnitResult, VectorCode, VectorCommand
from distbelief.runtime.algorithms.sandblaster.workqueue import WorkQueue
from distbelief.runtime.client.group import Reply, ShardGroup
from distbelief.runtime.observe.metrics import CoordinatorMetrics
from distbelief.runtime.transport import interface, zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Header, Status

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
MAX_IDLE = 4096            # replicas remembered as waiting for a unit
IDLE_CHECK_SECONDS = 0.5   # after converging: how often to look whether the chief has ended the job


@dataclasses.dataclass(frozen=True)
class CoordinatorSettings:
    bind: str
    examples: int                  # the batch: the whole training set
    unit_size: int = 64
    backups: bool = True
    reissue_after: float = 30.0
    max_iterations: int = 1000
    lbfgs: LbfgsSettings = LbfgsSettings()
    security: keys.ServerSecurity | None = None


class Coordinator:
    def __init__(self, settings: CoordinatorSettings, group: ShardGroup, metrics: CoordinatorMetrics, *,
                 transport_: interface.Transport | None = None, stop: threading.Event | None = None) -> None:
        self.settings, self.group, self.metrics = settings, group, metrics
        self.queue = WorkQueue(settings.examples, settings.unit_size, backups=settings.backups,
                               reissue_after=settings.reissue_after)
        self.shards = SandblasterShards(group)
        self.space = ShardSpace(self.shards, self._evaluate)
        self.lbfgs = Lbfgs(self.space, settings.lbfgs)
        self.state: LbfgsState | None = None
        self.failure: BaseException | None = None
        self.on_failure: Callable[[], None] = lambda: None        # a dead coordinator must not hang the job
        self.on_evaluated: Callable[[int], None] = lambda examples: None  # examples behind each evaluation
        self.endpoint = settings.bind
        self._stop = stop or group.stop
        self._transport = transport_ or zmq_transport.default()
        self._server: interface.Server | None = None
        # Replicas waiting for a unit, by the routing id of their connection (which a peer
        # cannot forge, unlike the worker id in its header); the longest waiting go first.
        self._idle: OrderedDict[bytes, tuple[Header, float]] = OrderedDict()  # replica -> its ask, and when
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._server = self._bind()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    @property
    def _bound(self) -> interface.Server:
        assert self._server is not None, "start() binds the server before the thread runs"
        return self._server

    def _bind(self) -> interface.Server:
        server = self._transport.server(self.settings.bind, who="the coordinator",
                                        max_frame=protocol.max_frame_bytes(0), max_frames=2,
                                        security=self.settings.security)
        self.endpoint = server.endpoint
        log.info("event=coordinator_listening address=%s units=%d unit_size=%d", self.endpoint,
                 self.queue.units, self.settings.unit_size)
        return server

    def _run(self) -> None:
        try:
            self._optimise()
            self._answer_done_until_stopped()
        except errors.Stopped:
            pass
        except Exception as exc:  # the coordinator must take its shard down rather than hang the job
            log.exception("event=coordinator_failed error=%r", str(exc))
            self.failure = exc
            self.on_failure()
        finally:
            self._bound.close()
            self.group.close()

    def _optimise(self) -> None:
        """Iterate until converged, out of iterations, or the job is done; recover on the way."""
        while not self._stop.is_set():
            try:
                state = self._resume()
                while state.converged is None and state.iteration < self.settings.max_iterations:
                    state = self.lbfgs.iterate(state)
                    self._commit(state)
                self._wait_for_the_end()
                return
            except errors.ShardRestarted as exc:
                self.metrics.recoveries.inc()
                log.warning("event=recovering reason=%r", str(exc))
            except errors.JobFinished:
                return

    def _wait_for_the_end(self) -> None:
        """Converged or out of iterations: the chief ends the job; replicas wait until then."""
        while not self._stop.is_set():
            self._serve(IDLE_CHECK_SECONDS)
            self.space.check_states(self.shards.state())

    # -- committed state ---------------------------------------------------------------------

    def _resume(self) -> LbfgsState:
        """Bring every shard to the newest iteration they all hold; a fresh start if none."""
        states = self.shards.state()
        self.space.incarnations = [int(s["incarnation"]) for s in states]
        common = set.intersection(*(set(s["checkpoints"]) for s in states))
        if common:
            iteration = max(common)
            self.space.check(self.shards.rollback(iteration))
            docs = [s["coordinator"] for s in self.space.check_states(self.shards.state())]
            if all(doc is not None and doc.get("iteration") == iteration for doc in docs):
                state = LbfgsState.from_json(docs[0])
                log.info("event=resumed iteration=%d objective=%.6g", state.iteration, state.objective)
                self._publish(state)
                return state
        state = self.lbfgs.initialize()
        self._commit(state)
        log.info("event=started objective=%.6g gradient_norm=%.3g", state.objective, state.gradient_norm)
        return state

    def _commit(self, state: LbfgsState) -> None:
        self.space.check(self.shards.commit(state.iteration, state.to_json()))
        self._publish(state)
        log.info("event=iteration iteration=%d objective=%.8g gradient_norm=%.3g evaluations=%d converged=%s",
                 state.iteration, state.objective, state.gradient_norm, state.evaluations, state.converged)

    def _publish(self, state: LbfgsState) -> None:
        self.state = state
        self.metrics.iteration.set(state.iteration)
        if state.objective is not None:
            self.metrics.objective.set(state.objective)
        self.metrics.gradient_norm.set(state.gradient_norm)

    # -- one evaluation over the whole batch -------------------------------------------------

    def _evaluate(self) -> float:
        started = time.perf_counter()
        evaluation = random.getrandbits(63) or 1
        self.space.check(self.shards.begin_evaluation(evaluation, self.queue.units))
        self.queue.begin(evaluation)
        self._offer()
        while not self.queue.finished:
            if self._stop.is_set():
                raise errors.Stopped("stopped during an evaluation")
            self._serve(POLL_SECONDS)
            self._offer()  # a unit out too long became a straggler: a waiting replica backs it up
        self._verify(evaluation)
        self.metrics.evaluations.inc()
        self.on_evaluated(self.settings.examples)
        self.metrics.evaluation_seconds.observe(time.perf_counter() - started)
        return self.queue.objective

    def _verify(self, evaluation: int) -> None:
        """Every shard holds every unit of this evaluation (none restarted meanwhile)."""
        states = self.space.check_states(self.shards.state())
        for shard, state in enumerate(states):
            if state["evaluation"] != evaluation or state["units"] != self.queue.units:
                raise errors.ShardRestarted(f"shard {shard} holds {state['units']} of {self.queue.units} units")

    def _serve(self, seconds: float) -> None:
        """Answer replicas' WORK requests for up to `seconds` (less once all units are in)."""
        deadline = time.monotonic() + seconds
        while True:
            if not self._bound.poll(max(0.0, deadline - time.monotonic())):
                return
            self._handle(self._bound.receive())
            if self.queue.finished and self.queue.evaluation:
                return

    def _handle(self, incoming: interface.Incoming | None) -> None:
        request = self._parse(incoming)
        if request is None or incoming is None:
            return  # dropped: nothing a replica could mistake for work
        header, result = request.header, request.meta
        self._idle[incoming.peer] = (header, time.monotonic())
        if len(self._idle) > MAX_IDLE:
            self._idle.popitem(last=False)  # one gone for longest: it asks again if it lives
        if result is not None:
            self._take(incoming.peer, header, result)
        self._hand_out(incoming.peer)

    def _parse(self, incoming: interface.Incoming | None) -> protocol.Message | None:
        try:
            if incoming is None or not incoming.frames:
                raise errors.ProtocolError("an empty message or one with too many frames")
            request = protocol.parse_request(incoming.frames)
            if request.spec is not ops.WORK or request.header.layout != self.group.layout.hash:
                raise errors.ProtocolError("expected a WORK request for this job's layout")
        except errors.ProtocolError as exc:
            log.warning("event=rejected role=coordinator reason=%r", str(exc))
            return None
        return request

    def _take(self, worker: bytes, header: Header, result: UnitResult) -> None:
        """A unit's result counts only from a replica the unit was handed to."""
        if not self.queue.holds(worker, result.evaluation, result.unit):
            log.warning("event=result_ignored role=coordinator worker=%08x unit=%d reason=not_handed_this_unit",
                        header.worker, result.unit)
            return
        if result.lost:
            raise errors.ShardRestarted(f"replica {header.worker:08x} found a shard without evaluation "
                                        f"{result.evaluation}")
        before = self.queue.stats.duplicates
        self.queue.complete(worker, result.evaluation, result.unit, result.loss)
        self.metrics.duplicates.inc(self.queue.stats.duplicates - before)

    def _offer(self) -> None:
        """Work for the replicas waiting, the latest to ask first. One that has waited longer
        than a replica's link waits for an answer asked again on a fresh connection: its old
        one is dropped, not handed units that no one would compute."""
        now = time.monotonic()
        for worker in reversed(list(self._idle)):
            if now - self._idle[worker][1] > ASK_POLICY.attempt:
                del self._idle[worker]
            else:
                self._hand_out(worker)

    def _hand_out(self, worker: bytes) -> None:
        header, _ = self._idle[worker]
        backups = self.queue.stats.backups
        unit = self.queue.assign(worker)
        if unit is None:
            return  # stays idle until a unit straggles or the next evaluation starts
        del self._idle[worker]
        self.metrics.units.inc()
        self.metrics.backups.inc(self.queue.stats.backups - backups)
        self._reply(worker, header, Status.OK, unit)

    def _reply(self, identity: bytes, header: Header, status: int, unit: ops.WorkUnit | None = None) -> None:
        if not self._bound.send(identity, protocol.reply_frames(header, step=0, status=status, meta=unit)):
            log.warning("event=reply_dropped role=coordinator worker=%08x", header.worker)

    def _answer_done_until_stopped(self) -> None:
        """The job is over: every replica that asks (or waits) hears so, until shard 0 exits."""
        for identity, (header, _) in self._idle.items():
            self._reply(identity, header, Status.DONE)
        self._idle.clear()
        while not self._stop.is_set():
            if self._bound.poll(POLL_SECONDS):
                incoming = self._bound.receive()
                request = self._parse(incoming)
                if request is not None and incoming is not None:
                    self._reply(incoming.peer, request.header, Status.DONE)


class ShardSpace:
    """lbfgs.VectorSpace over every shard's slices: one command per operation, to all
    shards at once; dot products are the sum of the shards' parts."""

    def __init__(self, shards: SandblasterShards, evaluate: Callable[[], float]) -> None:
        self.shards = shards
        self.evaluate = evaluate
        self.incarnations: list[int] = []

    def check(self, replies: list[Reply]) -> list[Reply]:
        """Raise if the job is done or a shard is not the process the coordinator knew."""
        if any(r.done for r in replies):
            raise errors.JobFinished()
        self._same_processes([r.meta.incarnation for r in replies])
        return replies

    def check_states(self, states: list[dict]) -> list[dict]:
        """check() for the shards' STATE documents."""
        self._same_processes([int(s["incarnation"]) for s in states])
        return states

    def _same_processes(self, incarnations: list[int]) -> None:
        for shard, incarnation in enumerate(incarnations):
            if self.incarnations and incarnation != self.incarnations[shard]:
                raise errors.ShardRestarted(f"shard {shard} restarted")

    def _run(self, code: VectorCode, out: int = 0, a: int = 0, b: int = 0, scalar: float = 0.0) -> float:
        replies = self.check(self.shards.vector(VectorCommand(code=code, out=out, a=a, b=b, scalar=scalar)))
        return sum(r.meta.value for r in replies)

    def dot(self, a: int, b: int) -> float:
        return self._run(VectorCode.DOT, a=a, b=b)

    def axpy(self, out: int, alpha: float, a: int) -> None:
        self._run(VectorCode.AXPY, out=out, a=a, scalar=alpha)

    def scale(self, out: int, alpha: float) -> None:
        self._run(VectorCode.SCALE, out=out, scalar=alpha)

    def copy(self, out: int, a: int) -> None:
        self._run(VectorCode.COPY, out=out, a=a)

