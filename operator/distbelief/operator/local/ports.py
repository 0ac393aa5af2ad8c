"""Loopback ports for local pods, chosen below the kernel's ephemeral range.

A port that bind(0) hands out comes from the ephemeral range, the range the kernel also
draws the source ports of outgoing connections from. Between local mode choosing a pod's
port and the pod binding it (a second or more, while Python starts), any connection made
on the machine could take that port, and the pod would fail with "Address already in
use". A port below the range is never handed out implicitly: only a program that binds
that very number can take it.
"""

from __future__ import annotations

import random
import socket

LOOPBACK = "127.0.0.1"
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LINUX_EPHEMERAL_START = 32768  # the kernel's default, where the file cannot be read
LOWEST = 10000                 # below: the well-known and registered services' usual ports
TRIES = 100


def ephemeral_start(path: str = EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_EPHEMERAL_START


class PortChooser:
    """Distinct loopback ports that are free now, below the ephemeral range where it leaves
    room (else from the kernel, as bind(0) gives them)."""

    def __init__(self, rng: random.Random | None = None, *, below: int | None = None) -> None:
        self.rng = rng or random.Random()
        self.below = ephemeral_start() if below is None else below
        self.chosen: set[int] = set()

    def port(self) -> int:
        if self.below - LOWEST >= 1000:
            for _ in range(TRIES):
                candidate = self.rng.randrange(LOWEST, self.below)
                if candidate not in self.chosen and _bindable(candidate):
                    self.chosen.add(candidate)
                    return candidate
        return self._from_kernel()

    def _from_kernel(self) -> int:
        while True:
            with socket.socket() as s:
                s.bind((LOOPBACK, 0))
                port = s.getsockname()[1]
            if port not in self.chosen:
                self.chosen.add(port)
                return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True
