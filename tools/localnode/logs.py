"""A container's log as a kubelet serves it at /containerLogs/NS/POD/CONTAINER (what
`kubectl logs` reaches through the API server): the whole log, its last tailLines lines
or limitBytes bytes, and with follow=true what the container writes next, until it stops
running or the client goes away.

A container's log is one file over all its runs (the agent appends each run's output),
so previous=true gives the same file.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import time
from typing import Callable, Mapping

FOLLOW_SECONDS = 0.2


@dataclasses.dataclass(frozen=True)
class LogSource:
    path: str
    running: Callable[[], bool]


def on_disk(root: str, namespace: str, pod: str, container: str) -> LogSource | None:
    """The newest log of a pod of that name the agent kept under root (a pod that has left)."""
    pattern = os.path.join(glob.escape(os.path.join(root, "logs", f"{namespace}_{pod}_")) + "*", f"{container}.log")
    found = [path for path in glob.glob(pattern) if os.path.isfile(path)]
    return LogSource(max(found, key=os.path.getmtime), lambda: False) if found else None


def selected(data: bytes, query: Mapping[str, str]) -> bytes:
    """data cut as tailLines and limitBytes ask (the end of the log, at most that much)."""
    if query.get("tailLines", "").isdigit():
        lines = data.splitlines(keepends=True)
        data = b"".join(lines[len(lines) - int(query["tailLines"]):]) if int(query["tailLines"]) else b""
    if query.get("limitBytes", "").isdigit():
        data = data[: int(query["limitBytes"])]
    return data


def serve(source: LogSource, query: Mapping[str, str], write: Callable[[bytes], None]) -> None:
    """Write the log (see the module's docstring); OSError when the client has gone."""
    with open(source.path, "rb") as f:
        write(selected(f.read(), query))
        if query.get("follow") != "true":
            return
        while True:
            chunk = f.read()
            if chunk:
                write(chunk)
            elif not source.running():
                return
            else:
                time.sleep(FOLLOW_SECONDS)
