"""The bulk channel's framing: length-prefixed messages on a non-blocking TCP socket.

    hello     HELLO_MAGIC, session id, counter, tag     once, first, client to server
    message   HEAD (session id, counter, frame count), each frame's length (u32), the
              head's tag (HEAD_TAG bytes), the frames

A receiver reads a message's head and lengths, checks them against its Limits and the
head's tag (the stream's owner's check_head: sessions.py), and only then reads the frames,
into a buffer of its pool that it reuses (`recv_into`). A message over the limits is
refused before a byte of its frames is buffered, so a connection holds at most one message
of the largest size allowed: no peer can make a process buffer more, however many frames it
sends. Streams that share a Budget buffer no more than it between them: a message that
does not fit waits, unread. What the bytes mean (sessions, tags) is sessions.py's.

Between processes of one machine a bulk port also listens on a Unix socket (localsocket.py),
and a link to a loopback address connects there first.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import socket
import struct
import time

from typing import Callable

from distbelief.runtime import errors
from distbelief.runtime.transport import localsocket

HELLO_MAGIC = b"DB-BULK1"
HELLO = struct.Struct("<8s16sQ16s")     # magic, session id, counter, tag
PREFIX = struct.Struct("<16sQ")         # session id, counter: what names a message
HEAD = struct.Struct("<16sQI")          # PREFIX, then the frame count
LENGTH = struct.Struct("<I")
HEAD_TAG = 16                           # an AES-GCM tag over HEAD and the lengths
SOCKET_BUFFER = 4 << 20                 # kernel buffers: a pull of tens of MB in few wake-ups
READ_CHUNK = 1 << 22                    # at most this much per recv_into: others get their turn
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a receiver takes: frames per message, bytes per frame (tag included)."""

    max_frames: int
    max_frame: int


class BufferPool:
    """Byte buffers reused from message to message, so their pages stay mapped; at most
    `keep` are kept when released, the largest first."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: list[bytearray] = []

    def get(self, nbytes: int) -> bytearray:
        fitting = [b for b in self._free if len(b) >= nbytes]
        if fitting:
            buffer = min(fitting, key=len)
            self._free.remove(buffer)
            return buffer
        return bytearray(nbytes)

    def release(self, buffer: bytearray) -> None:
        self._free.append(buffer)
        self._free.sort(key=len, reverse=True)
        del self._free[self.keep:]


class Budget:
    """The bytes of messages that a server's streams may buffer at once, counted by what
    their vouched-for heads declare, from the moment a message's buffer is taken until it
    is done or its stream closes. A message is let in when it fits, or when nothing is held
    (one larger than the whole budget then goes alone); else its stream waits, unread,
    until grant() lets it in."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.used = nbytes, 0
        self.held: dict[Stream, tuple[int, float]] = {}  # stream -> (bytes, since when)
        self.waiting: dict[Stream, int] = {}             # stream -> bytes, in the order they came

    def take(self, stream: Stream, nbytes: int) -> bool:
        """Whether `stream` may buffer its message of `nbytes` now; if not, it waits."""
        if not self._fits(nbytes):
            self.waiting[stream] = nbytes
            return False
        self._hold(stream, nbytes)
        return True

    def give(self, stream: Stream) -> None:
        """`stream`'s message is done, or the stream closed: its bytes are free again."""
        self.waiting.pop(stream, None)
        nbytes, _ = self.held.pop(stream, (0, 0.0))
        self.used -= nbytes

    def grant(self) -> None:
        """The waiting streams that fit let in, the latest to come first: a replica whose
        attempt timed out has sent its request again on a fresh connection, so the oldest
        waiters are the likeliest to be abandoned (and under overload the requests still
        awaited go through, instead of every one of them timing out)."""
        for stream, nbytes in reversed(list(self.waiting.items())):
            if self._fits(nbytes):
                del self.waiting[stream]
                self._hold(stream, nbytes)
                stream.granted()

    def overdue(self, seconds: float) -> list[Stream]:
        """While a message waits: the streams that have held their bytes longer than `seconds`."""
        now = time.monotonic()
        return [s for s, (_, since) in self.held.items() if now - since > seconds] if self.waiting else []

    def _fits(self, nbytes: int) -> bool:
        return not self.held or self.used + nbytes <= self.nbytes

    def _hold(self, stream: Stream, nbytes: int) -> None:
        self.held[stream] = (nbytes, time.monotonic())
        self.used += nbytes


@dataclasses.dataclass(frozen=True)
class Message:
    """A message as it arrived: its HEAD's fields, its frames' lengths, and the frames, in
    the stream's buffer until Stream.done() is called."""

    prefix: bytes            # session id and counter: the first bytes of HEAD
    session_id: bytes
    counter: int
    lengths: tuple[int, ...]
    body: memoryview

    def frames(self) -> list[memoryview]:
        views, offset = [], 0
        for length in self.lengths:
            views.append(self.body[offset:offset + length])
            offset += length
        return views


def pack_head(session_id: bytes, counter: int, lengths: list[int], into: memoryview) -> int:
    """HEAD and the lengths written at the start of `into`; the bytes they take (the head's
    tag goes right after them)."""
    HEAD.pack_into(into, 0, session_id, counter, len(lengths))
    for i, length in enumerate(lengths):
        LENGTH.pack_into(into, HEAD.size + i * LENGTH.size, length)
    return HEAD.size + len(lengths) * LENGTH.size


# (the stream, HEAD and the lengths, their tag): raises BulkRejected unless the head is authentic
HeadCheck = Callable[["Stream", bytes, bytes], None]


class Stream:
    """One TCP connection of the bulk channel, non-blocking. pump() reads what has arrived
    (up to one whole message, kept until done()) and writes what is queued; `closed` once
    the peer went away or broke the framing. check_head vets each message's head before a
    buffer is taken for its frames (None: heads are taken as they come); then the budget,
    if any, lets the message in or makes it wait (`waiting`: nothing is read) until granted()."""

    def __init__(self, sock: socket.socket, limits: Limits, pool: BufferPool, *, expects_hello: bool,
                 check_head: HeadCheck | None = None, budget: Budget | None = None) -> None:
        sock.setblocking(False)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        self.sock, self.limits, self.pool, self.fd = sock, limits, pool, sock.fileno()
        self.check_head, self.budget = check_head, budget
        self.closed, self.opened = False, time.monotonic()
        self.hello: bytes | None = None   # a hello read and not yet admit()ted: reading waits
        self.owner: object = None         # who the admitted hello proved the peer to be
        self.message: Message | None = None
        self._outbox: collections.deque[tuple[memoryview, bytearray | None]] = collections.deque()
        self._queued_bytes = 0
        self._small = bytearray(max(HELLO.size, HEAD.size + limits.max_frames * LENGTH.size + HEAD_TAG))
        self._expecting_hello = expects_hello
        self._reset()

    def ready_in(self, ready: dict) -> bool:
        """Whether a zmq.Poller's result names this stream (it names plain sockets by descriptor)."""
        return not self.closed and self.fd in ready

    @property
    def waiting(self) -> bool:
        """Whether a message's head waits for the budget to let its frames in."""
        return self._stage == "waiting"

    @property
    def queued(self) -> int:
        return len(self._outbox)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    # -- writing --------------------------------------------------------------------------

    def send(self, data: memoryview, buffer: bytearray | None = None) -> None:
        """Queue `data` (a view of `buffer`, which goes back to the pool once sent) and write
        what the socket takes now."""
        self._outbox.append((data, buffer))
        self._queued_bytes += len(data)
        self.flush()

    def flush(self) -> int:
        """Write queued bytes until the socket takes no more; the bytes written."""
        written = 0
        while self._outbox and not self.closed:
            data, buffer = self._outbox[0]
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close()
                break
            written += sent
            self._queued_bytes -= sent
            if sent < len(data):
                self._outbox[0] = (data[sent:], buffer)
                continue
            self._outbox.popleft()
            if buffer is not None:
                self.pool.release(buffer)
        return written

    # -- reading --------------------------------------------------------------------------

    def pump(self) -> int:
        """Flush, then read until the socket is empty or a message is whole (it waits in
        `message` until done()); the bytes read. BulkRejected when the peer breaks the
        framing: the caller logs it, then closes the stream."""
        self.flush()
        read = 0
        while not self.closed and self.message is None and self.hello is None and not self.waiting:
            chunk = self._read_some()
            if chunk is None:
                break
            read += chunk
            if self._filled == self._need:
                self._advance()
        return read

    def admit(self, owner: object) -> None:
        """The hello proved `owner`: messages are read from now on."""
        self.hello, self.owner = None, owner

    def granted(self) -> None:
        """The budget let the waiting message in: its frames are read from now on."""
        self._take_body()

    def done(self) -> None:
        """The message in `message` was used: its buffer goes back to the pool, its bytes to the budget."""
        if self.message is not None:
            self.pool.release(self._body)
            if self.budget is not None:
                self.budget.give(self)
            self.message = None
            self._reset()

    def _read_some(self) -> int | None:
        target = self._target()
        try:
            count = self.sock.recv_into(target[self._filled:self._need][:READ_CHUNK])
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            self.close()
            return None
        if count == 0:
            self.close()
            return None
        self._filled += count
        return count

    def _target(self) -> memoryview:
        return memoryview(self._body if self._stage == "body" else self._small)

    def _reset(self) -> None:
        self._stage = "hello" if self._expecting_hello else "head"
        self._need, self._filled = (HELLO.size if self._expecting_hello else HEAD.size), 0
        self._lengths: tuple[int, ...] = ()
        self._body = bytearray()

    def _advance(self) -> None:
        {"hello": self._got_hello, "head": self._got_head, "lengths": self._got_lengths,
         "body": self._got_body}[self._stage]()

    def _got_hello(self) -> None:
        hello, self._expecting_hello = bytes(self._small[:HELLO.size]), False
        if HELLO.unpack(hello)[0] != HELLO_MAGIC:
            raise errors.BulkRejected("a connection that does not start with the bulk channel's hello")
        self._reset()
        self.hello = hello

    def _got_head(self) -> None:
        count = HEAD.unpack_from(self._small)[2]
        if not 1 <= count <= self.limits.max_frames:
            raise errors.BulkRejected(f"a message of {count} frames (at most {self.limits.max_frames} are taken)")
        self._stage, self._need = "lengths", HEAD.size + count * LENGTH.size + HEAD_TAG

    def _got_lengths(self) -> None:
        count = HEAD.unpack_from(self._small)[2]
        self._lengths = struct.unpack_from(f"<{count}I", self._small, HEAD.size)
        largest = max(self._lengths)
        if largest > self.limits.max_frame:
            raise errors.BulkRejected(f"a frame of {largest} bytes (at most {self.limits.max_frame} are taken)")
        if self.check_head is not None:
            head = HEAD.size + count * LENGTH.size
            self.check_head(self, bytes(self._small[:head]), bytes(self._small[head:head + HEAD_TAG]))
        if self.budget is None or self.budget.take(self, sum(self._lengths)):
            self._take_body()
        else:
            self._stage = "waiting"

    def _take_body(self) -> None:
        total = sum(self._lengths)
        self._body = self.pool.get(total)
        self._stage, self._need, self._filled = "body", total, 0
        if total == 0:
            self._got_body()

    def _got_body(self) -> None:
        session_id, counter, _ = HEAD.unpack_from(self._small)
        self._stage = "whole"
        self.message = Message(prefix=bytes(self._small[:PREFIX.size]), session_id=session_id, counter=counter,
                               lengths=self._lengths, body=memoryview(self._body)[:sum(self._lengths)])

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()
            if self.budget is not None:
                self.budget.give(self)
            for _, buffer in self._outbox:
                if buffer is not None:
                    self.pool.release(buffer)
            self._outbox.clear()
            self._queued_bytes = 0


def listen(address: str) -> socket.socket:
    """A listening TCP socket for `tcp://HOST:PORT` (PORT `*` or 0: any free one)."""
    host, port = split_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::" if host == "*" and family == socket.AF_INET6 else "0.0.0.0" if host == "*" else host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def connect(host: str, port: int) -> socket.socket:
    """A connection to the bulk port at host:port: its Unix socket when host is loopback
    and it has one, else TCP, started and not waited for (its first writes queue until it is up)."""
    local = localsocket.connect(port) if host in LOOPBACK else None
    if local is not None:
        return local
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    code = sock.connect_ex(address)
    if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
        sock.close()
        raise OSError(code, f"cannot connect to {host}:{port}: {errno.errorcode.get(code, code)}")
    return sock


def split_address(address: str) -> tuple[str, int]:
    """('HOST', PORT) of `tcp://HOST:PORT`; PORT `*` is 0 (any free one)."""
    if not address.startswith("tcp://") or ":" not in address[6:]:
        raise errors.ConfigError(f"the bulk channel needs a tcp://HOST:PORT address, not {address!r}")
    host, port = address[6:].rsplit(":", 1)
    return host.strip("[]"), 0 if port == "*" else int(port)
