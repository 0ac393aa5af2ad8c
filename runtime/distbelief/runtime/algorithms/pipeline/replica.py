"""One pod of a partitioned replica: stage k of the model, in a group with one pod of
every other partition.

    partition 0 (drives the group's steps)      partition k > 0 (answers FORWARDs)
    pull its stage every fetchEvery steps,      pull when PREFETCH says a step will
    after PREFETCH to the stages after it       fetch (a thread), pass it on
    forward its minibatch -> FORWARD to 1 ...   forward -> FORWARD to k+1 (the last
                                                stage computes the loss instead)
    backward from the gradient that came back   backward, answer k-1 with d(loss)/d(input);
    HOLD, wait for the others' HOLD status,     on a PUSH step HOLD its gradient, then
    then PREPARE_HELD and APPLY_HELD on every   answer k-1 again with the worst HOLD
    shard (or DROP_HELD)                        status of its own and k+1's

Each pod pulls from and holds gradients on only the shards of its own stage. Every stage
holds its gradient as soon as its backward is done, while the stages before it compute
theirs, so the holds run at once rather than one after another. A step counts (its update
applied on every shard) only once partition 0 sends APPLY_HELD, which it does after every
stage's HOLD status reached it and every shard pinned its part (PREPARE_HELD, staged.py). A step that is not applied (too
stale somewhere, a shard without room to hold it, a part lost) is dropped on every shard;
after a shard had no room (FULL) the group backs off before its next step. A group that
breaks mid-step leaves nothing applied; its pods drop what they accumulated and join new
groups.

With spec.model.microBatches M > 1 a step's minibatch goes down in M FORWARDs, GPipe's
order: partition 0 computes and sends every part's forward before it waits for the first
answer, each stage passes each part on as it comes and, once the last is passed on,
computes each part's backward as its answer comes back and answers it at once. The parts'
gradients add up to the minibatch's (stages.py) and are held once, with the last part.
Every part of a step is computed from the step's one pull and the step is applied on
every shard at once, so no part ever meets weights newer than its own: PipeDream's weight
stashing (a copy of the weights per minibatch in flight) is not needed.

PREFETCH takes the later stages' pulls off the step's critical path: partition 0 sends it
once the last step is settled (applied everywhere or dropped), so every stage pulls at
the same moment as partition 0 itself, while partition 0 computes, and finds its
parameters there when the step's FORWARD arrives. Each stage pulls what it pulled before
(the state after the same commits), so the steps' staleness is unchanged.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Iterable, Iterator

import numpy as np

from distbelief.runtime import errors, jobspec
from distbelief.runtime.algorithms.pipeline import neighbour
from distbelief.runtime.algorithms.pipeline.commit import Backoff, Commit, new_token
from distbelief.runtime.algorithms.pipeline.ops import FETCH, HOLD, PUSH, Held
from distbelief.runtime.algorithms.pipeline.rendezvous import HEARTBEAT_SECONDS, RendezvousLink
from distbelief.runtime.client.group import ShardGroup
from distbelief.runtime.model.data import Dataset, minibatches
from distbelief.runtime.model.stages import Stage
from distbelief.runtime.observe.metrics import WorkerMetrics
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.transport import interface
from distbelief.runtime.wire.protocol import Status

log = logging.getLogger(__name__)

NON_FINITE_STEPS = 3  # pushes in a row behind a non-finite loss before the replica gives up


@dataclasses.dataclass(frozen=True)
class PodSettings:
    """What a partition pod's loop takes of the job: spec.training (batchSize, fetchEvery,
    pushEvery), spec.model.microBatches (each minibatch goes through the stages in as many
    parts), the data's classes, and the seed of its minibatches (None: a fresh stream)."""

    training: jobspec.Training
    micro_batches: int = 1
    classes: int = 2
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class PodLinks:
    """A partition pod's peers: its stage's shards, the rendezvous, how to reach a
    neighbour stage, and (partition 0) every shard, for the warm-start and APPLY_HELD."""

    own: ShardGroup
    rendezvous: RendezvousLink
    transport: interface.Transport
    stage_security: dict | None
    everyone: ShardGroup | None = None


def worst(statuses: Iterable[int]) -> int:
    """Of a step's HOLD statuses, the one that decides it: DONE, FULL, STALE, else OK."""
    seen = set(statuses)
    return next((s for s in (Status.DONE, Status.FULL, Status.STALE) if s in seen), Status.OK)


class PartitionPod(abc.ABC):
    """What both kinds of partition pod share: the stage's parameters and gradient, the
    pulls and holds on its shards, the group and its heartbeat."""

    def __init__(self, settings: PodSettings, stage: Stage, links: PodLinks, metrics: WorkerMetrics, *,
                 stop: threading.Event) -> None:
        self.settings, self.stage, self.links, self.metrics = settings, stage, links, metrics
        self.params = np.empty(stage.size, dtype=np.float32)
        self.accumulated = np.zeros(stage.size, dtype=np.float32)
        self._step_grad = np.empty(stage.size, dtype=np.float32)
        self.pulled_steps = [0] * len(links.own.indices)
        self.stop_requested = stop
        self.joined = threading.Event()
        self.steps = 0
        self.group = 0
        self._beat = 0.0
        self._downstream: neighbour.Neighbour | None = None
        self._counted = (0, 0)
        self._closed_links = [0, 0]  # bytes in and out of the neighbour links of earlier groups

    def run(self) -> str:
        """Train in groups until the job is done or stop is requested; returns why it ended."""
        try:
            if not self._hello():
                return "done"
            while not self.stop_requested.is_set():
                view = self.links.rendezvous.wait_for_group()
                if view is None:
                    return "done"
                if self._in_group(view):
                    return "done"
        except errors.Stopped:
            pass
        finally:
            self.close()
        return "stopped"

    def close(self) -> None:
        self.links.rendezvous.close()

    def _in_group(self, view: dict) -> bool:
        """Train in one group until it breaks (False) or the job is done (True)."""
        self.group, self._beat = int(view["group"]), time.monotonic()
        downstream = view.get("downstream")
        self._downstream = neighbour.Neighbour(
            self.links.transport, downstream, security=self.links.stage_security, layout=self.links.own.layout.hash,
            worker_id=self.links.own.worker_id, heartbeat=self.heartbeat) if downstream else None
        log.info("event=group_joined partition=%d group=%016x downstream=%s", self.stage.index, self.group, downstream)
        try:
            return self.train()
        except errors.GroupBroken as exc:
            log.warning("event=group_broken partition=%d group=%016x reason=%r", self.stage.index, self.group, str(exc))
            self.accumulated[...] = 0
            return False
        finally:
            if self._downstream is not None:
                self._closed_links[0] += self._downstream.bytes_in
                self._closed_links[1] += self._downstream.bytes_out
                self._downstream.close()
                self._downstream = None
            self.group = 0

    @abc.abstractmethod
    def train(self) -> bool:
        """Train in the current group: True when the job is done, False when stopped."""

    def heartbeat(self) -> None:
        """Keep the group's lease; GroupBroken if the group broke elsewhere."""
        if time.monotonic() - self._beat < HEARTBEAT_SECONDS:
            return
        self._beat = time.monotonic()
        status, view = self.links.rendezvous.ask(self.group)
        if status == Status.DONE:
            raise errors.GroupBroken("the job is done")
        if status != Status.OK or view is None or view.get("group") != self.group:
            raise errors.GroupBroken("the rendezvous dissolved the group")

    def _hello(self) -> bool:
        """Check the layout with the shards (partition 0: every shard, for the warm-start)."""
        shards = self.links.everyone or self.links.own
        while not self.stop_requested.is_set():
            replies = shards.hello()
            if any(r.done for r in replies):
                return False
            if all(r.header.status == Status.OK for r in replies):
                self.joined.set()
                return True
            self.stop_requested.wait(0.5)
        raise errors.Stopped("stopped before joining")

    def pull(self) -> bool:
        """This stage's parameters from its shards; True if the job is done."""
        started = time.perf_counter()
        replies = Float32Dense(self.links.own).pull(self.params)
        self.metrics.pull_seconds.observe(time.perf_counter() - started)
        if any(r.done for r in replies):
            return True
        self.pulled_steps = [r.step for r in replies]
        return False

    def compute(self, activations: list[np.ndarray], upstream: np.ndarray, *, share: float = 1.0,
                last: bool = True) -> tuple[float, np.ndarray | None]:
        """Backward through the stage for one micro-batch (share: its fraction of the step's
        rows; last: the step's last), its gradient added to the accumulated one."""
        loss, input_grad = self.stage.backward(self.params, activations, upstream, self._step_grad, share=share,
                                               l2=last)
        self.accumulated += self._step_grad
        if last:
            self.steps += 1
            self.metrics.steps.inc()
            self._count_traffic()
        return loss, input_grad

    def hold(self, token: int) -> int:
        """Hold the accumulated gradient on this stage's shards: OK, STALE, FULL (a shard
        had no room for it) or DONE. Every stage holds its part at once, whatever the
        others' came to: a step that is not applied is dropped on every shard after."""
        started = time.perf_counter()
        replies = self.links.own.request(HOLD, meta=Held(self.group, token), array=self.accumulated,
                                         steps=self.pulled_steps)
        self.metrics.push_seconds.observe(time.perf_counter() - started)
        self.accumulated[...] = 0
        return worst(r.header.status for r in replies)

    def _count_traffic(self) -> None:
        """What this pod's clients moved since the last count, into its metrics."""
        clients = [c for c in (self.links.own, self.links.everyone, self._downstream) if c is not None]
        now = (self._closed_links[0] + sum(c.bytes_in for c in clients),
               self._closed_links[1] + sum(c.bytes_out for c in clients))
        before, self._counted = self._counted, now
        self.metrics.bytes_in.inc(now[0] - before[0])
        self.metrics.bytes_out.inc(now[1] - before[1])


class FirstPartition(PartitionPod):
    """Partition 0: reads the data and drives its group's steps."""

    def __init__(self, settings: PodSettings, stage: Stage, links: PodLinks, metrics: WorkerMetrics,
                 dataset: Dataset | None, *, stop: threading.Event,
                 batches: Iterator[tuple[np.ndarray, np.ndarray]] | None = None) -> None:
        """batches: its minibatches when they do not come from the data set (a streamed file source)."""
        super().__init__(settings, stage, links, metrics, stop=stop)
        self.rng = np.random.default_rng(settings.seed)
        self.batches = batches if batches is not None else minibatches(dataset, settings.training.batch_size, self.rng)
        if links.everyone is None:
            raise ValueError("partition 0 commits its steps on every shard: it needs links.everyone")
        self.commits = Commit(links.everyone)
        self.backoff = Backoff()
        self.committed = 0  # steps this pod applied on every shard
        self._non_finite = 0

    def close(self) -> None:
        super().close()
        self.links.own.close()  # its own subset of the shards; `everyone` is the role's to close

    @property
    def _next_stage(self) -> neighbour.Neighbour:
        assert self._downstream is not None, "partition 0 has a next stage in every group"
        return self._downstream

    def train(self) -> bool:
        step, fetch = 0, True
        examples, loss_sum = 0, 0.0
        while not self.stop_requested.is_set():
            fetch = fetch or step % self.settings.training.fetch_every == 0
            push = (step + 1) % self.settings.training.push_every == 0
            token = new_token()
            if fetch and self._fetch(token):
                return True
            with self._dropped_on_break(token) if push else contextlib.nullcontext():
                downstream, loss, n = self._step(token, (FETCH if fetch else 0) | (PUSH if push else 0))
            if downstream.status == Status.DONE:
                return True
            examples, loss_sum, step, fetch = examples + n, loss_sum + loss * n, step + 1, False
            if push:
                outcome = self._commit(token, examples, loss_sum / examples)
                if outcome == Status.DONE:
                    return True
                fetch, examples, loss_sum = outcome != Status.OK, 0, 0.0
                self.committed += outcome == Status.OK
                if outcome == Status.FULL:
                    self.backoff.wait(self.stop_requested)
                else:
                    self.backoff.reset()
            self.heartbeat()
        return False

    def _fetch(self, token: int) -> bool:
        """The later stages start pulling for the step (PREFETCH) as this stage pulls; True if the job is done."""
        self._next_stage.notify(self.group, token)
        return self.pull()

    def _step(self, token: int, flags: int) -> tuple[neighbour.Downstream, float, int]:
        """One minibatch through the stages, micro-batch after micro-batch: every forward
        first (the next stage works on one while this stage computes the next), then each
        backward as its answer comes back. Its HOLD statuses come after (_commit)."""
        x, y = next(self.batches)
        parts = min(self.settings.micro_batches, len(x))
        micro = list(zip(np.array_split(x, parts), np.array_split(y, parts)))
        stashed = []
        for part, (xm, ym) in enumerate(micro):
            stashed.append(self.stage.forward(self.params, xm))
            part_flags = (flags & FETCH if part == 0 else 0) | (flags & PUSH if part == parts - 1 else 0)
            self._next_stage.send(self.group, token, stashed[-1][-1], ym, flags=part_flags, part=part, parts=parts,
                                  step_rows=len(x))
        loss = 0.0
        for part, ((xm, _), activations) in enumerate(zip(micro, stashed)):
            downstream = self._next_stage.answer()
            if downstream.status == Status.DONE:
                return downstream, 0.0, 0
            own, _ = self.compute(activations, downstream.grad, share=len(xm) / len(x), last=part == parts - 1)
            loss += own + downstream.loss
        self.metrics.examples.inc(len(x))
        self.metrics.loss.set(loss)
        return downstream, loss, len(x)

    def _commit(self, token: int, examples: int, loss: float) -> int:
        """Apply the step on every shard or on none (commit.py): OK, STALE, FULL or DONE."""
        with self._dropped_on_break(token):
            own = self.hold(token) if np.isfinite(loss) else Status.STALE  # a shard would refuse it
            held = worst([own, self._next_stage.held()])  # every stage held its part meanwhile
        if not np.isfinite(loss):
            self._drop_non_finite(loss)
            return self.commits.drop(self.group, token, Status.STALE)
        self._non_finite = 0
        if held == Status.STALE:
            self.metrics.stale.inc()
        return self.commits.settle(self.group, token, held, examples=examples, loss=loss)

    @contextlib.contextmanager
    def _dropped_on_break(self, token: int) -> Iterator[None]:
        """A group that breaks during a step may have left it held on some shards: free that room now."""
        try:
            yield
        except errors.GroupBroken:
            self.commits.drop(self.group, token, Status.STALE)
            raise

    def _drop_non_finite(self, loss: float) -> None:
        self._non_finite += 1
        self.accumulated[...] = 0
        log.error("event=non_finite_loss partition=0 step=%d action=step_not_applied", self.steps)
        if self._non_finite >= NON_FINITE_STEPS:
            raise errors.Diverged(f"the training loss was {loss} for {self._non_finite} steps in a row: "
                                  "lower spec.training.learningRate, or check the data")
