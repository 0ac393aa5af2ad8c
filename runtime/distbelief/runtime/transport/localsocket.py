"""The Unix socket beside a bulk port, for the roles of one machine (local mode).

Where the roles are given a private folder for sockets (DISTBELIEF_SOCKET_DIR: local mode
makes one per run, mode 0700), a bulk port also listens on a Unix socket there, named after
its TCP port, and a link to a loopback address connects there first: the same bytes move
1.5-2 times as fast as over loopback TCP. The folder is the proof of who listens: no other
user can make a socket in it, so none can stand in for a shard, and a live holder of the
name makes the port refuse to start. On a cluster the folder is unset: TCP between pods.
"""

from __future__ import annotations

import errno
import os
import socket
import stat

from distbelief.runtime import contract, errors


def local_path(port: int) -> str | None:
    """The Unix socket of the bulk port at `port`, in the roles' private socket folder;
    None without one (a cluster's pods: each role in a pod of its own)."""
    folder = os.environ.get(contract.ENV_SOCKET_DIR)
    return os.path.join(folder, f"bulk-{port}") if folder else None


def listen_local(port: int) -> socket.socket | None:
    """The Unix socket beside the bulk port at `port`, or None without a socket folder.
    A folder others may write to is refused, and so is a name a live process holds; a
    socket left by a process that died is replaced."""
    path = local_path(port)
    if path is None:
        return None
    _check_private(os.path.dirname(path))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.exists(path):
            _take_over(path)
        sock.bind(path)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise errors.ConfigError(f"the bulk port's Unix socket {path}: {exc}") from exc
    sock.setblocking(False)
    return sock


def _check_private(folder: str) -> None:
    mode = os.stat(folder).st_mode
    if not stat.S_ISDIR(mode) or mode & 0o077:
        raise errors.ConfigError(f"{contract.ENV_SOCKET_DIR}={folder} must be a folder only its owner may use "
                                 f"(mode 0700, not {stat.filemode(mode)})")


def _take_over(path: str) -> None:
    """Remove the socket at `path` if nothing answers there; refuse if something does."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # its process died
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, "taken by a live process: another bulk port of this port number")


def unlink_local(sock: socket.socket) -> None:
    """Close a Unix listener of listen_local() and remove its name."""
    path = sock.getsockname()
    sock.close()
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def connect(port: int) -> socket.socket | None:
    """A connection to the Unix socket of the bulk port at `port`, or None where it has none
    (or it refuses: the caller takes TCP)."""
    path = local_path(port)
    if path is None or not os.path.exists(path):
        return None
    local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        local.connect(path)  # at once: accepted into the backlog, or refused
        return local
    except OSError:
        local.close()
        return None
