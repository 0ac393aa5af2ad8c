"""Local pods' ports: chosen below the kernel's ephemeral range (which outgoing connections'
source ports come from), distinct, and free when chosen."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from distbelief.operator.local import ports
from distbelief.operator.local.ports import PortChooser


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    chooser = PortChooser(random.Random(7))
    chosen = [chooser.port() for _ in range(200)]
    assert len(set(chosen)) == 200
    assert all(ports.LOWEST <= p < ports.ephemeral_start() for p in chosen)
    for port in chosen[:20]:
        with socket.socket() as s:
            s.bind((ports.LOOPBACK, port))  # free when chosen (nothing here binds them)


class Scripted(random.Random):
    """Draws the given ports in order."""

    def __init__(self, draws: list[int]) -> None:
        super().__init__()
        self.draws = draws

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int:  # type: ignore[override]
        return self.draws.pop(0)


def test_a_port_another_program_listens_on_is_passed_over() -> None:
    with socket.socket() as held:
        held.bind((ports.LOOPBACK, 0))
        held.listen()
        taken = held.getsockname()[1]
        with socket.socket() as probe:
            probe.bind((ports.LOOPBACK, 0))
            free = probe.getsockname()[1]
        chooser = PortChooser(Scripted([taken, free]), below=10 ** 5)
        assert chooser.port() == free


def test_without_room_below_the_range_the_kernel_chooses(tmp_path: Path) -> None:
    narrow = tmp_path / "range"
    narrow.write_text("10500\t60999\n")
    assert ports.ephemeral_start(str(narrow)) == 10500
    assert ports.ephemeral_start(str(tmp_path / "missing")) == ports.LINUX_EPHEMERAL_START
    chooser = PortChooser(below=10500)
    assert chooser.port() >= 1024 and len({chooser.port() for _ in range(50)}) == 50
