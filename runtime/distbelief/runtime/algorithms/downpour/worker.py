"""One model replica running Downpour SGD.

    pull every fetchEvery steps   -> params (all shards at once, straight into one buffer)
    compute the minibatch gradient, accumulate it
    push every pushEvery steps    -> each shard gets its slice of the accumulated gradient

A push followed at once by a fetch is one PUSH_PULL round trip: the shards reply with
their parameters, the push included, instead of waiting for a separate pull. A shard
that found the push staler than maxStaleness did not apply it; the replica then
computes its next gradient from fresh parameters.

With spec.training.overlap, that round trip runs on a thread of its own while the next
step computes (ps-lite's push -> ticket, then wait(ticket), one ticket out at a time):

    compute step k on the parameters exchange k-2 brought back
    wait for exchange k-1 (push of step k-1's gradient, pull of the parameters after it)
    start exchange k (step k's gradient), and compute step k+1 on exchange k-1's parameters

Each gradient is then one step staler, and the shards' maxStaleness check counts that,
as each push names the steps of the parameters it was computed from.

Warm-start: shard 0 admits one replica at a time until warmstartSteps updates are
applied; the others wait. The replica stops (exit 0) as soon as any shard says the job
is done, and on SIGTERM after its current step.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Sequence

import numpy as np

from distbelief.runtime import errors, jobspec
from distbelief.runtime.client.group import Reply, ShardGroup
from distbelief.runtime.model import models
from distbelief.runtime.model.data import Dataset, minibatches
from distbelief.runtime.observe.metrics import WorkerMetrics
from distbelief.runtime.params import dense_client

log = logging.getLogger(__name__)

WARMSTART_POLL_SECONDS = 0.5
NON_FINITE_PUSHES = 3  # pushes in a row behind a non-finite loss before a replica gives up


class Worker:
    def __init__(self, training: jobspec.Training, group: ShardGroup, model: models.Model, dataset: Dataset | None,
                 metrics: WorkerMetrics, *, seed: int | None = None, stop: threading.Event | None = None,
                 wire_format: str = "float32", batches: Iterator[tuple[np.ndarray, ...]] | None = None) -> None:
        """training: spec.training, whose batchSize, fetchEvery, pushEvery and overlap it follows;
        seed: its minibatches' (None: a fresh stream per process, as replicas must differ);
        wire_format: spec.parameterServers.wireFormat, the format of its pulls and pushes;
        batches: its minibatches when they do not come from the data set (a streamed file source)."""
        self.training, self.group, self.model, self.metrics = training, group, model, metrics
        self.dense = dense_client.of(group, wire_format)
        self.rng = np.random.default_rng(seed)
        self.batches = batches if batches is not None else self._minibatches(dataset)
        total = group.layout.total
        self.params = np.empty(total, dtype=np.float32)
        self.accumulated = np.zeros(total, dtype=np.float32)
        self._step_grad = np.empty(total, dtype=np.float32) if training.push_every > 1 else None
        self.pulled_steps = [0] * group.layout.shards
        self.stop_requested = stop or threading.Event()
        self.joined = threading.Event()
        self.steps = 0
        self.acknowledged = [0] * group.layout.shards  # pushes each shard said it applied
        self._counted = (0, 0, 0)
        self._non_finite = 0  # pushes in a row behind a non-finite loss

    def _minibatches(self, dataset: Dataset | None) -> Iterator[tuple[np.ndarray, ...]]:
        """Random minibatches of the data set's training part."""
        assert dataset is not None, "a replica is given its data set or its minibatches"
        return minibatches(dataset, self.training.batch_size, self.rng)

    def run(self) -> str:
        """Train until the job is done or stop is requested; returns why it ended."""
        if not self._join():
            return "stopped"
        if self.training.overlap:
            return self._run_overlapped()
        examples, loss_sum = 0, 0.0
        fetched = False  # the last push brought the parameters back: this step's fetch is done
        while not self.stop_requested.is_set():
            if self.steps % self.training.fetch_every == 0 and not fetched and self._pull():
                return "done"
            loss, n = self._compute()
            examples, loss_sum = examples + n, loss_sum + loss * n
            self.steps += 1
            fetched = False
            if self.steps % self.training.push_every == 0:
                fetched = self.steps % self.training.fetch_every == 0
                if self._push(examples, loss_sum / examples, fetch=fetched):
                    return "done"
                examples, loss_sum = 0, 0.0
        return "stopped"

    def _run_overlapped(self) -> str:
        """Steps that compute while the step before's exchange is on the wire (the module's
        docstring). Only this thread touches params and pulled_steps; the exchange fills the
        other buffer, and its steps become pulled_steps when this thread swaps it in."""
        log.info("event=overlapped worker=%08x", self.group.worker_id)
        if self._pull():
            return "done"
        incoming, outgoing = np.empty_like(self.params), np.empty_like(self.accumulated)
        ticket: Future | None = None
        with ThreadPoolExecutor(1, thread_name_prefix="exchange") as wire:
            while not self.stop_requested.is_set():
                computed_on = self.pulled_steps
                loss, examples = self._compute()
                self.steps += 1
                if ticket is not None:
                    fresh = ticket.result()
                    if fresh is None:
                        return "done"
                    self.params, incoming, self.pulled_steps = incoming, self.params, fresh
                self.accumulated, outgoing = outgoing, self.accumulated
                ticket = wire.submit(self._exchange, outgoing, incoming, computed_on, examples, loss)
            return "done" if ticket is not None and ticket.result() is None else "stopped"

    def _exchange(self, grad: np.ndarray, into: np.ndarray, steps: Sequence[int], examples: int,
                  loss: float) -> list[int] | None:
        """Push grad (computed from parameters of `steps`) and pull into `into`: the steps of
        what came back, or None when the job is done. A gradient behind a non-finite loss is
        dropped and the parameters pulled alone."""
        started = time.perf_counter()
        if self._keeps(loss):
            replies = self.dense.push_and_pull(grad, into, steps=steps, examples=examples, loss=loss)
            self.metrics.push_seconds.observe(time.perf_counter() - started)
            self._account(replies, steps)
        else:
            replies = self.dense.pull(into)
            self.metrics.pull_seconds.observe(time.perf_counter() - started)
        self._count_traffic()
        return None if any(r.done for r in replies) else [r.header.step for r in replies]

    def _join(self) -> bool:
        """Say hello to every shard (which checks the layout); wait out a warm-start."""
        while not self.stop_requested.is_set():
            replies = self.group.hello()
            if any(r.done for r in replies):
                return False
            if all(r.header.status == 0 for r in replies):
                self.joined.set()
                log.info("event=joined worker=%08x shards=%d", self.group.worker_id, len(replies))
                return True
            self.stop_requested.wait(WARMSTART_POLL_SECONDS)
        return False

    def _pull(self) -> bool:
        started = time.perf_counter()
        replies = self.dense.pull(self.params)
        self.metrics.pull_seconds.observe(time.perf_counter() - started)
        self._count_traffic()
        if any(r.done for r in replies):
            return True
        self.pulled_steps = [r.header.step for r in replies]
        return False

    def _compute(self) -> tuple[float, int]:
        out = self.accumulated if self._step_grad is None else self._step_grad
        loss, examples = self._gradient(out)
        if self._step_grad is not None:
            self.accumulated += self._step_grad
        self.metrics.steps.inc()
        self.metrics.examples.inc(examples)
        self.metrics.loss.set(loss)
        return loss, examples

    def _gradient(self, out: np.ndarray) -> tuple[float, int]:
        """One minibatch's loss, its dense gradient written into out, and its example count."""
        x, y = next(self.batches)
        loss, _ = self.model.loss_and_grad(self.params, (x, y), out=out)
        return loss, len(x)

    def _push(self, examples: int, loss: float, *, fetch: bool) -> bool:
        """Push the accumulated gradient; with fetch, the replies also refill self.params.

        A gradient behind a non-finite loss is dropped, not pushed (_keeps)."""
        if not self._keeps(loss):
            self.accumulated[...] = 0
            return self._pull() if fetch else False
        started = time.perf_counter()
        if fetch:
            replies = self.dense.push_and_pull(self.accumulated, self.params, steps=self.pulled_steps,
                                               examples=examples, loss=loss)
        else:
            replies = self.dense.push(self.accumulated, steps=self.pulled_steps, examples=examples, loss=loss)
        self.metrics.push_seconds.observe(time.perf_counter() - started)
        self._count_traffic()
        if self._step_grad is not None:
            self.accumulated[...] = 0
        self._account(replies, self.pulled_steps)
        if any(r.done for r in replies):
            return True
        if fetch:
            self.pulled_steps = [r.header.step for r in replies]
        elif any(r.stale for r in replies):
            return self._pull()  # a shard found the parameters too old: compute from fresh ones
        return False

    def _keeps(self, loss: float) -> bool:
        """Whether a gradient behind this loss may be pushed: not when the loss is not finite
        (the shards would refuse it). After NON_FINITE_PUSHES such gradients in a row the
        model has diverged, and the replica stops with Diverged (its exit code fails the job
        as NonFiniteLoss)."""
        if np.isfinite(loss):
            self._non_finite = 0
            return True
        self._non_finite += 1
        log.error("event=non_finite_loss worker=%08x step=%d action=gradient_dropped", self.group.worker_id,
                  self.steps)
        if self._non_finite >= NON_FINITE_PUSHES:
            raise errors.Diverged(
                f"the training loss was {loss} for {self._non_finite} pushes in a row, at global step "
                f"{max(self.pulled_steps)} (this replica's minibatch {self.steps}): lower "
                "spec.training.learningRate, or check the data")
        return False

    def _account(self, replies: Sequence[Reply], pulled_steps: Sequence[int]) -> None:
        """Count a push's outcome per shard: stale (refused), or applied, and how stale."""
        for shard, (pulled, reply) in enumerate(zip(pulled_steps, replies)):
            if reply.stale:
                self.metrics.stale.inc()
            elif not reply.done:  # applied: a shard that finished answers DONE instead
                self.acknowledged[shard] += 1
                self.metrics.acknowledged.labels(shard=str(shard)).inc()
                self.metrics.staleness.observe(max(0, reply.header.step - 1 - pulled))

    def _count_traffic(self) -> None:
        now = (self.group.bytes_in, self.group.bytes_out, self.group.retries)
        before, self._counted = self._counted, now
        self.metrics.bytes_in.inc(now[0] - before[0])
        self.metrics.bytes_out.inc(now[1] - before[1])
        self.metrics.retries.inc(now[2] - before[2])
