"""The unit tier's rule, enforced: no real sockets and no processes while a test runs.

Python sockets (connect, connect_ex, bind), ZeroMQ sockets on any transport but inproc://
(libzmq opens them itself, past Python's socket module), and new processes (subprocess,
multiprocessing, os.fork, os.posix_spawn) raise UnitTierViolation instead. A unit test talks through the in-memory
transport or zmq inproc://.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import os
import socket
import subprocess
from typing import Any, Callable, Iterator

import zmq

MESSAGE = "unit tests use no sockets or processes: move this test to tests/integration"


class UnitTierViolation(RuntimeError):
    pass


def _refuse(what: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise UnitTierViolation(f"{MESSAGE} ({what})")
    return refused


def _inproc_only(original: Callable[..., Any], verb: str) -> Callable[..., Any]:
    def checked(self: zmq.Socket, addr: str, *args: Any, **kwargs: Any) -> Any:
        if not str(addr).startswith("inproc://"):
            raise UnitTierViolation(f"{MESSAGE} (zmq {verb} {addr}; only inproc:// is in memory)")
        return original(self, addr, *args, **kwargs)
    return checked


def _replacements() -> list[tuple[Any, str, Any]]:
    return [
        (socket.socket, "connect", _refuse("socket.connect")),
        (socket.socket, "connect_ex", _refuse("socket.connect_ex")),
        (socket.socket, "bind", _refuse("socket.bind")),
        (zmq.Socket, "bind", _inproc_only(zmq.Socket.bind, "bind")),
        (zmq.Socket, "connect", _inproc_only(zmq.Socket.connect, "connect")),
        (subprocess.Popen, "__init__", _refuse("subprocess")),
        (os, "fork", _refuse("os.fork")),
        (os, "forkpty", _refuse("os.forkpty")),
        (os, "posix_spawn", _refuse("os.posix_spawn")),
        (os, "posix_spawnp", _refuse("os.posix_spawnp")),
        (_posixsubprocess, "fork_exec", _refuse("a new process")),  # multiprocessing's spawn
    ]


@contextlib.contextmanager
def no_sockets_or_processes() -> Iterator[None]:
    """While inside, every real socket and new process raises UnitTierViolation."""
    replacements = _replacements()
    own = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in replacements]  # None: inherited
    try:
        for owner, name, replacement in replacements:
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in own:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
