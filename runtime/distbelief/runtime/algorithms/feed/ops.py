"""The work-unit op on the wire (the dispenser beside shard 0 serves it on the coordinator
port), its payloads, and a replica's link to the dispenser.

    NEXT_UNIT   UnitAsk in: the unit just finished (if any), whether another is wanted
                -> OK + UnitGiven (a unit and its epoch); WAIT (none wanted, or none free
                   now: every unit is out); or DONE (the job is over)
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

from distbelief.runtime import errors
from distbelief.runtime.algorithms.chiefport import ChiefPortLink
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import OpSpec, Payload

MAX_UNITS = 1 << 24          # work units in one file set
NONE = 0xFFFFFFFF            # UnitAsk.finished when no unit was finished


@dataclasses.dataclass(frozen=True)
class UnitAsk(Payload):
    """A replica's request: the unit it finished (NONE: none) of epoch `epoch`, and whether
    it wants another (0: it only reports, and renews the lease on the units it holds)."""

    finished: int = NONE
    epoch: int = 0
    want: int = 1
    FORMAT = struct.Struct("<IIB3x")

    def check(self) -> None:
        if self.finished != NONE and self.finished >= MAX_UNITS:
            raise errors.ProtocolError(f"unit {self.finished} is beyond {MAX_UNITS} units")
        if self.want not in (0, 1):
            raise errors.ProtocolError("want is 0 or 1")


@dataclasses.dataclass(frozen=True)
class UnitGiven(Payload):
    unit: int
    epoch: int
    FORMAT = struct.Struct("<II")

    def check(self) -> None:
        if self.unit >= MAX_UNITS:
            raise errors.ProtocolError(f"unit {self.unit} is beyond {MAX_UNITS} units")


NEXT_UNIT = protocol.define(OpSpec(50, "NEXT_UNIT", request=UnitAsk, reply=UnitGiven))


class DispenserLink(ChiefPortLink):
    """A replica's request/reply channel to the dispenser."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        super().__init__(address, who="the data dispenser", **kwargs)

    def ask(self, request: UnitAsk) -> tuple[int, UnitGiven | None]:
        """(status, the unit handed out or None)."""
        return self.request(NEXT_UNIT, request, UnitGiven)  # type: ignore[return-value]
