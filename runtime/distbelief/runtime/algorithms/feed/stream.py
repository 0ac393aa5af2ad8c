"""A replica's minibatches from the units the dispenser hands it: a prefetch thread asks for
units and reads them while the replica computes; a shuffle buffer mixes their examples.

    prefetch thread: NEXT_UNIT -> read the unit (files.FileSet.read) -> the loaded queue
    next():          loaded units -> the shuffle buffer -> a random minibatch out of it

For a model with embeddings (with_ids) each example's id columns ride with its features
and label through the buffer, and the minibatches are (x, y, ids).

A unit is reported finished once every example of it has left the buffer in a minibatch,
so a replica that stops or dies holds, at most, the units in its buffer and its queue;
the dispenser hands them out again once its lease runs out (units.py). Memory: the buffer (bufferExamples plus one unit) and
LOADED_AHEAD units read ahead, never the data set. A bad unit ends the replica with its
errors.BadData, or is skipped with spec.data.onBadFile: skip.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, NamedTuple

import numpy as np

from distbelief.runtime import errors
from distbelief.runtime.algorithms.feed import ops
from distbelief.runtime.model.files import FileSet
from distbelief.runtime.wire.protocol import Status

log = logging.getLogger(__name__)

BUFFER_EXAMPLES = 8192   # the shuffle buffer's fill before it takes no more units
LOADED_AHEAD = 2         # units read ahead of the buffer
RENEW_SECONDS = 2.0      # a replica with enough data still renews its lease this often
WAIT_SECONDS = 0.2       # after WAIT: ask again this much later


class Drawn(NamedTuple):
    """Examples drawn from the buffer: features, labels, id columns ([n, 0] without ids), tags."""

    x: np.ndarray
    y: np.ndarray
    ids: np.ndarray
    tag: np.ndarray


class ShuffleBuffer:
    """Examples of several units, each tagged with its unit; a minibatch is drawn at random.
    fields: the id columns each example carries (spec.data.ids; 0 without embeddings)."""

    def __init__(self, features: int, rng: np.random.Generator, capacity: int = 1024, *, fields: int = 0) -> None:
        self.rng = rng
        self.x = np.empty((capacity, features), np.float32)
        self.y = np.empty(capacity, np.int64)
        self.ids = np.empty((capacity, fields), np.int64)
        self.tag = np.empty(capacity, np.int64)
        self.size = 0

    def _columns(self) -> tuple[np.ndarray, ...]:
        return self.x, self.y, self.ids, self.tag

    def add(self, x: np.ndarray, y: np.ndarray, tag: int, ids: np.ndarray | None = None) -> None:
        """A unit's examples; ids: its id columns, required when the buffer has fields."""
        n = len(y)
        if (0 if ids is None else ids.shape[1]) != self.ids.shape[1]:
            raise ValueError(f"the buffer's examples carry {self.ids.shape[1]} id columns, these "
                             f"{0 if ids is None else ids.shape[1]}")
        if self.size + n > len(self.y):
            grown = max(2 * len(self.y), self.size + n)
            self.x, self.y, self.ids, self.tag = (np.resize(a, (grown, *a.shape[1:])) for a in self._columns())
        end = self.size + n
        self.x[self.size:end], self.y[self.size:end], self.tag[self.size:end] = x, y, tag
        if ids is not None:
            self.ids[self.size:end] = ids
        self.size = end

    def take(self, n: int) -> Drawn:
        """n examples drawn without replacement; the buffer's last rows fill their places."""
        n = min(n, self.size)
        picked = self.rng.choice(self.size, n, replace=False)
        out = Drawn(*(a[picked].copy() for a in self._columns()))
        keep = np.setdiff1d(np.arange(self.size - n, self.size), picked, assume_unique=True)
        holes = np.sort(picked[picked < self.size - n])
        for column in self._columns():
            column[holes] = column[keep]
        self.size -= n
        return out


class Batch(NamedTuple):
    """A streamed minibatch: features, labels, id columns ([n, 0] without ids), and the
    epoch of each example."""

    x: np.ndarray
    y: np.ndarray
    ids: np.ndarray
    epochs: np.ndarray


class StreamedBatches:
    """An endless stream of (x, y) minibatches from the units handed to this replica; with
    with_ids, of (x, y, ids): the file set's id columns too (a model with embeddings)."""

    def __init__(self, file_set: FileSet, link: Any, batch_size: int, rng: np.random.Generator, *,
                 stop: threading.Event, skip_bad: bool = False, buffer_examples: int = BUFFER_EXAMPLES,
                 with_ids: bool = False) -> None:
        if with_ids and not file_set.fields:
            raise errors.ConfigError(f"spec.data.ids: {file_set.spec.source} is read without id columns to embed")
        self.file_set, self.link, self.batch_size = file_set, link, batch_size
        self.stop, self.skip_bad, self.buffer_examples = stop, skip_bad, buffer_examples
        self.with_ids = with_ids
        self.buffer = ShuffleBuffer(file_set.n_features, rng, fields=file_set.fields if with_ids else 0)
        self.loaded: queue.Queue = queue.Queue(maxsize=LOADED_AHEAD)
        self.finished: queue.SimpleQueue = queue.SimpleQueue()   # (epoch, unit) to report
        self.units: dict[int, list[int]] = {}                      # tag -> [epoch, unit, examples left]
        self.ended: BaseException | None = None
        self.examples_read = 0
        self._wake = threading.Event()
        self._tags = 0
        self._thread = threading.Thread(target=self._prefetch, name="prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> "StreamedBatches":
        return self

    def __next__(self) -> tuple[np.ndarray, ...]:
        batch = self.next_batch()
        return (batch.x, batch.y, batch.ids) if self.with_ids else (batch.x, batch.y)

    def next_batch(self) -> Batch:
        """A minibatch and the epoch of each of its examples."""
        self._fill()
        x, y, ids, tags = self.buffer.take(self.batch_size)
        epochs = np.empty(len(tags), np.int64)
        for tag, count in zip(*np.unique(tags, return_counts=True)):
            entry = self.units[int(tag)]
            epochs[tags == tag] = entry[0]
            entry[2] -= int(count)
            if entry[2] == 0:
                del self.units[int(tag)]
                self.finished.put((entry[0], entry[1]))
                self._wake.set()
        return Batch(x, y, ids, epochs)

    def _fill(self) -> None:
        """Take loaded units while the buffer has room; block until it holds a minibatch."""
        while self.buffer.size < self.buffer_examples and self.ended is None:
            needed = self.buffer.size < self.batch_size
            try:
                item = self.loaded.get(timeout=0.5) if needed else self.loaded.get_nowait()
            except queue.Empty:
                if not needed:
                    return
                if self.stop.is_set():
                    raise errors.Stopped("the replica is stopping") from None
                continue
            self._wake.set()   # room in the loaded queue: the prefetch thread reads the next unit
            if isinstance(item, errors.BadData):
                raise item
            if isinstance(item, BaseException):
                self.ended = item   # the job is done, or the thread failed: serve what is buffered
            else:
                self._add(*item)
        if self.buffer.size == 0:
            raise errors.Stopped("the data stream ended") from self.ended

    def _add(self, epoch: int, unit: int, part: tuple) -> None:
        x, y, ids = part
        self._tags += 1
        self.units[self._tags] = [epoch, unit, len(y)]
        self.buffer.add(x, y, self._tags, ids if self.with_ids else None)
        self.examples_read += len(y)

    # -- the prefetch thread -------------------------------------------------------------------

    def _prefetch(self) -> None:
        try:
            while not self.stop.is_set():
                self._wake.clear()       # before looking: a wake after the look is not lost
                self._report_finished()
                if self.loaded.full():   # LOADED_AHEAD units wait for room in the buffer
                    if not self._wake.wait(RENEW_SECONDS):
                        self._ask(ops.UnitAsk(want=0))   # still alive: keep the lease
                    continue
                status, given = self._ask(ops.UnitAsk())
                if status == Status.DONE:
                    raise errors.Stopped("the job is done")
                if given is None:
                    self.stop.wait(WAIT_SECONDS)
                    continue
                self._load(given)
        except BaseException as exc:  # the replica's thread raises it from next()
            self.loaded.put(exc)

    def _load(self, given: ops.UnitGiven) -> None:
        unit = self.file_set.train_units[given.unit]
        try:
            part = self.file_set.read(unit)
        except errors.BadData as exc:
            if not self.skip_bad:
                raise
            log.warning("event=bad_unit_skipped unit=%s reason=%r", unit.where(), str(exc))
            self.finished.put((given.epoch, given.unit))
            return
        log.info("event=unit_read epoch=%d unit=%d rows=%d where=%r", given.epoch, given.unit, len(part[1]),
                 unit.where())
        if len(part[1]) == 0:
            self.finished.put((given.epoch, given.unit))
            return
        while not self.stop.is_set():
            try:
                self.loaded.put((given.epoch, given.unit, part), timeout=RENEW_SECONDS)
                return
            except queue.Full:
                self._ask(ops.UnitAsk(want=0))

    def _report_finished(self) -> None:
        while True:
            try:
                epoch, unit = self.finished.get_nowait()
            except queue.Empty:
                return
            self._ask(ops.UnitAsk(finished=unit, epoch=epoch, want=0))

    def _ask(self, ask: ops.UnitAsk) -> tuple[int, ops.UnitGiven | None]:
        return self.link.ask(ask)

    def close(self) -> None:
        self.stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
