"""The dispenser: beside shard 0, it hands the replicas work units on the coordinator port.

It serves NEXT_UNIT (ops.py) from its own thread and ROUTER socket, with the job's keys
(in a partitioned job, the rendezvous's on the same port hands it those requests), and
keeps units.Units' books; a replica is known by the worker id in its header (a
replica that reconnects keeps its units). Its figures (`epoch`, units handed out, taken
back) go into the chief's history lines and result.json, and its position into
`data-position.json` beside the checkpoints, from which a restarted shard 0 resumes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Callable

from distbelief.runtime import errors, keys
from distbelief.runtime.algorithms.feed import ops
from distbelief.runtime.algorithms.feed.units import Units
from distbelief.runtime.transport import interface, zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Status

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
POSITION_FILE = "data-position.json"


@dataclasses.dataclass(frozen=True)
class DispenserSettings:
    bind: str
    units: int
    seed: int
    layout: int
    lease: float = 30.0                 # seconds a silent replica keeps its units
    position_dir: str | None = None     # where the position is recorded (the checkpoint folder)
    record_every: float = 5.0
    security: keys.ServerSecurity | None = None


class Dispenser:
    def __init__(self, settings: DispenserSettings, *, stop: threading.Event, is_done: Callable[[], bool] = lambda: False,
                 transport_: interface.Transport | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """is_done: the job is over (shard 0 finished it); every ask then hears DONE."""
        self.settings, self.clock, self.is_done = settings, clock, is_done
        self.units = Units(settings.units, seed=settings.seed, lease=settings.lease)
        self.failure: BaseException | None = None
        self._stop = stop
        self._lock = threading.Lock()
        self._transport = transport_ or zmq_transport.default()
        self._server: interface.Server | None = None
        self._recorded = 0.0
        self.endpoint = settings.bind
        self._thread = threading.Thread(target=self._run, name="dispenser", daemon=True)
        self._resume()

    def start(self) -> "Dispenser":
        self._server = self._transport.server(self.settings.bind, who="the data dispenser",
                                              max_frame=protocol.max_frame_bytes(0), max_frames=2,
                                              security=self.settings.security)
        self.endpoint = self._server.endpoint
        log.info("event=dispenser_listening address=%s units=%d", self.endpoint, self.units.count)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def figures(self) -> dict:
        with self._lock:
            return {"epoch": round(self.units.epochs, 4), "unitsHandedOut": self.units.handed_out,
                    "unitsTakenBack": self.units.taken_back}

    # -- the position ------------------------------------------------------------------------

    def _position_path(self) -> str | None:
        folder = self.settings.position_dir
        return os.path.join(folder, POSITION_FILE) if folder else None

    def _resume(self) -> None:
        path = self._position_path()
        if not path or not os.path.exists(path):
            return
        try:
            with open(path, encoding="utf-8") as f:
                position = json.load(f)
            if position.get("units") != self.units.count:
                raise ValueError(f"it records {position.get('units')} units, the file set has {self.units.count}")
            self.units.restore(position)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("event=data_position_ignored path=%s reason=%r", path, str(exc))
            return
        log.info("event=data_resumed epoch=%d finished=%d", self.units.epoch, len(position.get("finished", [])))

    def record(self) -> None:
        """Write the position (atomically) beside the checkpoints."""
        path = self._position_path()
        if not path:
            return
        with self._lock:
            position = {**self.units.position(), "units": self.units.count}
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(position, f)
        os.replace(path + ".tmp", path)

    # -- serving -----------------------------------------------------------------------------

    def _run(self) -> None:
        server = self._server
        assert server is not None, "start() binds the server before the thread runs"
        try:
            while not self._stop.is_set():
                if server.poll(POLL_SECONDS):
                    self.handle(server, server.receive())
                self.tick()
        except Exception as exc:  # a dead dispenser must take its shard down rather than starve the job
            log.exception("event=dispenser_failed error=%r", str(exc))
            self.failure = exc
        finally:
            server.close()

    def tick(self) -> None:
        """Record the position when record_every has passed (the serving loop calls it)."""
        now = self.clock()
        if now - self._recorded >= self.settings.record_every:
            self._recorded = now
            try:
                self.record()
            except OSError as exc:
                log.warning("event=data_position_unwritten reason=%r", str(exc))

    def handle(self, server: interface.Server, incoming: interface.Incoming | None) -> None:
        """Answer one NEXT_UNIT on `server` (its own, or the rendezvous's it shares a port with)."""
        try:
            if incoming is None or not incoming.frames:
                raise errors.ProtocolError("an empty message")
            request = protocol.parse_request(incoming.frames)
            if request.spec is not ops.NEXT_UNIT or request.header.layout != self.settings.layout:
                raise errors.ProtocolError("expected a NEXT_UNIT request for this job's layout")
        except errors.ProtocolError as exc:
            log.warning("event=rejected role=dispenser reason=%r", str(exc))
            return
        status, given = self.answer(request.header.worker, request.meta)
        if not server.send(incoming.peer, protocol.reply_frames(request.header, step=0, status=status, meta=given)):
            log.warning("event=reply_dropped role=dispenser worker=%08x", request.header.worker)

    def answer(self, worker: int, ask: ops.UnitAsk) -> tuple[int, ops.UnitGiven | None]:
        """What a replica's ask gets: (status, unit)."""
        if self.is_done():
            return Status.DONE, None
        now = self.clock()
        with self._lock:
            self.units.renew(worker, now)
            self.units.expire(now)
            if ask.finished != ops.NONE:
                self.units.finish(worker, ask.epoch, ask.finished)
            if not ask.want:
                return Status.WAIT, None
            epoch, unit = self.units.hand_out(worker, now)
        return Status.OK, ops.UnitGiven(unit=unit, epoch=epoch)
