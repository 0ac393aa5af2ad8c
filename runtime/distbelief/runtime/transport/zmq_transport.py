"""The roles' transport: ZeroMQ over tcp:// (or ipc://), one context per process.

    ZmqTransport   makes ZmqServers (zmq_server.py) and ZmqLinks (zmq_link.py), and waits
                   on several links at once; default() is what the roles use

ZeroMQ is imported by this package alone (admission.py registers the ZAP handler for it;
keys.py, beside the layers, makes the keys), and its errors are translated here into
distbelief.runtime.errors and nowhere else.
"""

from __future__ import annotations

import time
from typing import Sequence, cast

import zmq

from distbelief.runtime import keys
from distbelief.runtime.transport.interface import Link
from distbelief.runtime.transport.zmq_link import ZmqLink
from distbelief.runtime.transport.zmq_server import ZmqServer


class ZmqTransport:
    """ZeroMQ over tcp:// (or ipc://), one context per process by default."""

    def __init__(self, context: zmq.Context | None = None) -> None:
        self.context = context or zmq.Context.instance()

    def server(self, address: str, *, who: str, max_frame: int, max_frames: int,
               security: keys.ServerSecurity | None, bulk: str | None = None) -> ZmqServer:
        return ZmqServer(self.context, address, who=who, max_frame=max_frame, max_frames=max_frames,
                         security=security, bulk=bulk)

    def link(self, address: str | Sequence[str], options: dict | None, *, watch: bool = True,
             bulk: bool = False, heartbeat: float | None = None) -> ZmqLink:
        return ZmqLink(self.context, address, options, watch=watch, bulk=bulk, heartbeat=heartbeat)

    def wait(self, links: Sequence[Link], seconds: float) -> dict:
        """What is ready, once one of links (made by this transport) has a reply to read (or
        a monitor event) or `seconds` passed; meanwhile the links' bulk connections write and
        read (pump)."""
        own = cast("Sequence[ZmqLink]", links)
        deadline = time.monotonic() + seconds
        while True:
            poller = zmq.Poller()
            for link in own:
                for pollable, flags in link.pollables():
                    poller.register(pollable, flags)
            waiting = any(link.pending() for link in own)
            ready = dict(poller.poll(0 if waiting else int(max(0.0, deadline - time.monotonic()) * 1000)))
            woken = [link.pump(ready) for link in own]
            if any(woken) or time.monotonic() >= deadline:
                return ready


def default() -> ZmqTransport:
    return ZmqTransport()

