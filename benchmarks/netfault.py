"""A TCP proxy on loopback that delays, holds or cuts the traffic between two processes, one
direction at a time: the network faults of the copies checker (copycheck.py).

    net = Net().start()
    link = net.proxy(shard_port, bulk_port)  # link.address: connect here instead of the target
    link.up.delay = 0.2                    # what the connecting side sends arrives 0.2 s later
    link.down.blocked = True               # what the target answers is held (not read: TCP
                                           # pushes back, the target's queues fill)
    link.reset()                           # cut every connection: what was held is lost
    net.stop()

A link listens on a loopback address of its own (127.0.0.2, 127.0.0.3, ...) at the very
port numbers of its targets: a peer that learns a port number from the target (a shard's
session grant names its bulk port) and connects to it at the host it already uses goes
through the same link, and suffers the same faults.

Each connection is two pumps (up: client to target, down: target to client). A pump reads
only while its direction is not blocked, and writes each chunk `delay` seconds after it
arrived, in order. Everything runs in one asyncio loop on a thread of its own.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
from typing import Any

LOOPBACK = "127.0.0.1"
CHUNK = 1 << 16


@dataclasses.dataclass
class Direction:
    delay: float = 0.0
    blocked: bool = False

    def heal(self) -> None:
        self.delay, self.blocked = 0.0, False


class Link:
    """Ports on one loopback address of its own, each forwarding to the same port on LOOPBACK."""

    def __init__(self, net: Net, host: str, target_ports: tuple[int, ...]) -> None:
        self.net, self.host, self.target_ports = net, host, target_ports
        self.up, self.down = Direction(), Direction()
        self.connections: collections.Counter[int] = collections.Counter()  # target port -> connections taken
        self._writers: set[asyncio.StreamWriter] = set()
        self._servers: list[asyncio.base_events.Server] = []

    @property
    def port(self) -> int:
        return self.target_ports[0]

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def heal(self) -> None:
        self.up.heal()
        self.down.heal()

    def reset(self) -> None:
        """Cut every connection now (held bytes are lost); new ones are taken as before."""
        self.net.call(self._reset)

    async def _reset(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _listen(self) -> None:
        for port in self.target_ports:
            self._servers.append(await asyncio.start_server(
                lambda reader, writer, port=port: self._connected(port, reader, writer), self.host, port))

    async def _connected(self, port: int, client_reader: asyncio.StreamReader,
                         client_writer: asyncio.StreamWriter) -> None:
        self.connections[port] += 1
        try:
            target_reader, target_writer = await asyncio.open_connection(LOOPBACK, port)
        except OSError:
            client_writer.transport.abort()
            return
        self._writers |= {client_writer, target_writer}
        pumps = [asyncio.create_task(_pump(client_reader, target_writer, self.up)),
                 asyncio.create_task(_pump(target_reader, client_writer, self.down))]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for writer in (client_writer, target_writer):
            writer.transport.abort()
            self._writers.discard(writer)

    async def _close(self) -> None:
        for server in self._servers:
            server.close()
        await self._reset()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: Direction) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            arrived, data = await queue.get()
            while direction.blocked:  # noqa: ASYNC110 (set from the caller's thread, not the loop's)
                await asyncio.sleep(0.01)
            wait = arrived + direction.delay - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
            queue.task_done()

    delivering = asyncio.create_task(deliver())
    try:
        while not delivering.done():
            if direction.blocked:
                await asyncio.sleep(0.01)
                continue
            if queue.qsize() > 64:  # a slow delivery pushes back on the sender too
                await asyncio.sleep(0.005)
                continue
            data = await reader.read(CHUNK)
            if not data:
                break
            queue.put_nowait((loop.time(), data))
        while not queue.empty() and not delivering.done():  # noqa: ASYNC110 what arrived before the end still goes
            await asyncio.sleep(0.005)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        delivering.cancel()


class Net:
    """Every proxy of a check, on one event loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.links: list[Link] = []
        self._thread = threading.Thread(target=self.loop.run_forever, name="netfault", daemon=True)

    def start(self) -> Net:
        self._thread.start()
        return self

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine(), self.loop).result(timeout=30)

    def proxy(self, *target_ports: int) -> Link:
        """A link to target_ports on LOOPBACK, on the next loopback address of its own."""
        link = Link(self, f"127.0.0.{len(self.links) + 2}", target_ports)
        self.call(link._listen)
        self.links.append(link)
        return link

    def heal(self) -> None:
        for link in self.links:
            link.heal()

    def stop(self) -> None:
        for link in self.links:
            self.call(link._close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
