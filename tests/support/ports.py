"""Free loopback ports, for servers whose address must be known before they start: drawn
as local mode draws its pods' (below the kernel's ephemeral range, distbelief.operator.local.ports),
by one chooser for the whole test process, so that no port is handed out twice."""

from __future__ import annotations

from distbelief.operator.local.ports import PortChooser

_CHOOSER = PortChooser()


def free_ports(count: int) -> list[int]:
    """count distinct ports free on 127.0.0.1 now, none handed out before in this process."""
    return [_CHOOSER.port() for _ in range(count)]


def free_port() -> int:
    (port,) = free_ports(1)
    return port
