"""Free loopback ports, for servers whose address must be known before they start."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """count distinct ports free on 127.0.0.1 now (all held open together, so none repeats)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    (port,) = free_ports(1)
    return port
