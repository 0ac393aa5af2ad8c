"""The bytes a process moved over the job's transport, whichever of its roles moved them
(shard, chief, coordinator, replica): a pod's traffic, as its metrics report it."""

from __future__ import annotations

import threading


class Traffic:
    """Frames' bytes as sent and received (CurveZMQ's boxes and TCP's framing not counted).
    Sockets of several threads add to one count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_in = 0
        self.bytes_out = 0

    def received(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_in += nbytes

    def sent(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_out += nbytes


# Every ZeroMQ socket of this process (transport/) counts here.
PROCESS_TRAFFIC = Traffic()
