"""The unit tier's guard (support/isolation.py, installed by tests/unit/conftest.py): real
sockets and new processes fail a unit test with the same clear message; zmq inproc:// works."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys

import pytest
import zmq

from support.isolation import MESSAGE, UnitTierViolation, no_sockets_or_processes


def test_a_python_socket_may_neither_bind_nor_connect() -> None:
    with socket.socket() as s:
        with pytest.raises(UnitTierViolation, match=MESSAGE):
            s.bind(("127.0.0.1", 0))
        with pytest.raises(UnitTierViolation, match="connect"):
            s.connect(("127.0.0.1", 9))
        with pytest.raises(UnitTierViolation, match="connect_ex"):
            s.connect_ex(("127.0.0.1", 9))


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:*", "ipc:///tmp/unit.sock"])
def test_a_zmq_socket_stays_in_memory(address: str) -> None:
    context = zmq.Context()
    try:
        with context.socket(zmq.PAIR) as sock:
            with pytest.raises(UnitTierViolation, match="only inproc:// is in memory"):
                sock.bind(address)
            with pytest.raises(UnitTierViolation, match=MESSAGE):
                sock.connect(address.replace("*", "5555"))
    finally:
        context.term()


def test_zmq_inproc_carries_messages() -> None:
    context = zmq.Context()
    try:
        with context.socket(zmq.PAIR) as a, context.socket(zmq.PAIR) as b:
            a.bind("inproc://unit-tier")
            b.connect("inproc://unit-tier")
            a.send(b"ping")
            assert b.recv() == b"ping"
    finally:
        context.term()


def test_no_process_starts() -> None:
    with pytest.raises(UnitTierViolation, match="subprocess"):
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(UnitTierViolation, match="os.fork"):
        os.fork()
    process = multiprocessing.get_context("spawn").Process(target=print)
    with pytest.raises(UnitTierViolation, match="a new process"):
        process.start()


def test_a_nested_guard_leaves_the_outer_one_in_place() -> None:
    with no_sockets_or_processes():
        pass
    with pytest.raises(UnitTierViolation):
        socket.socket().bind(("127.0.0.1", 0))
