"""The bulk channel's cryptography: AES-256-GCM sessions agreed over CurveZMQ.

CurveZMQ encrypts at 0.2-0.4 GB/s; AES-GCM with the CPU's AES instructions at several
GB/s. So a shard's link does its handshake, and asks for a session, over the CurveZMQ
socket, and sends its requests (and gets its replies) over a TCP connection of our own
framing (framing.py) to the server's bulk port, each message sealed here:

    SESSION request   SESSION_MAGIC, over CurveZMQ (which proved the peer's key)
    SESSION reply     SESSION_MAGIC + session id (16 random bytes) + key (32 random bytes)
                      + the bulk port (2 bytes, little-endian; 0: no bulk channel here)
    hello             the first bytes of a bulk connection: the session id, a counter, and
                      a tag under the session key over them (the proof the server admits)
    bulk message      HEAD (session id, counter, frame count), the lengths, a tag over
                      both (checked before a byte of the frames is buffered), then each
                      frame sealed on its own: AES-256-GCM under the session key, nonce =
                      direction, frame index, counter; associated data = session id and
                      counter, direction, frame count

The server makes the key (fresh, random) and binds the session to the CurveZMQ
connection that asked for it: the ZAP user (so the chief's key keeps its privileges and
a replica's key gets none) and the link's routing id. A bulk connection is admitted by its
hello alone, and then carries only sessions of the same peer. A counter is never reused
within a direction of a session (the hello takes one too), so no nonce repeats under a
key; the receiver takes a message only if its counter is above every counter it accepted
before (replays and reordered messages are refused), and only after every frame's tag
checked (nothing of a forged message reaches the shard). A frame moved to another
message, position or direction fails its tag.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import struct
import time
from typing import Any, Callable, Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from distbelief.runtime import errors
from distbelief.runtime.transport import framing

log = logging.getLogger(__name__)

SESSION_MAGIC = b"DB-SESSION-1"
ID_BYTES, KEY_BYTES, TAG_BYTES = 16, 32, 16
PREFIX = framing.PREFIX                      # session id, message counter
NONCE = struct.Struct("<BB2xQ")              # direction, frame index, counter: 12 bytes
GRANT = struct.Struct(f"<{len(SESSION_MAGIC)}s{ID_BYTES}s{KEY_BYTES}sH")
NO_GRANT = GRANT.pack(SESSION_MAGIC, bytes(ID_BYTES), bytes(KEY_BYTES), 0)  # "no bulk channel here"
TO_SERVER, TO_CLIENT = 0, 1
HELLO_INDEX = 255        # the hello's frame index in its nonce: no message has that many frames
HEAD_INDEX = 254         # a message head's, likewise
MAX_SESSIONS = 4096      # per server; the least recently used goes first
MAX_PER_PEER = 4         # per CurveZMQ connection (ZAP user and routing id)
# A client asks for a fresh key after this many bytes under one (both ways): 2^32 AES
# blocks, which keeps GCM's distinguishing bound near 2^-65 however long a job runs.
REKEY_BYTES = 1 << 36
REFUSAL_LOG_SECONDS = 10.0

Frame = bytes | memoryview


@dataclasses.dataclass(eq=False)
class Session:
    """One end of a session. `sent` is the counter of the last message sealed, `accepted`
    the highest counter taken from the other end."""

    id: bytes
    key: bytes
    user: str | None = None     # the ZAP user of the CurveZMQ connection that made it
    peer: bytes = b""           # that connection's routing id
    route: Any = None           # the bulk connection its last message came by (a framing.Stream)
    sent: int = 0
    accepted: int = 0
    volume: int = 0             # bytes sealed and opened under the key

    @property
    def worn_out(self) -> bool:
        return self.volume >= REKEY_BYTES

    @property
    def owner(self) -> tuple[str | None, bytes]:
        return self.user, self.peer

    def __post_init__(self) -> None:
        self._aead = AESGCM(self.key)

    def hello(self) -> bytes:
        """A bulk connection's first bytes: this session's id, a fresh counter, and a tag
        under its key over both: the proof that admits the connection."""
        self.sent += 1
        tag = self._aead.encrypt(NONCE.pack(TO_SERVER, HELLO_INDEX, self.sent), b"", _hello_aad(self.id, self.sent))
        return framing.HELLO.pack(framing.HELLO_MAGIC, self.id, self.sent, tag)

    def check_hello(self, hello: bytes) -> None:
        """Take a connection's hello for this session; BulkRejected if it is not a fresh one of it."""
        _, session_id, counter, tag = framing.HELLO.unpack(hello)
        counter = self.counter_of(PREFIX.pack(session_id, counter))
        try:
            self._aead.decrypt(NONCE.pack(TO_SERVER, HELLO_INDEX, counter), tag, _hello_aad(self.id, counter))
        except InvalidTag as exc:
            raise errors.BulkRejected("a hello that failed its authentication tag") from exc
        self.accept(counter)

    def seal_into(self, direction: int, frames: Sequence[Frame], pool: framing.BufferPool) -> tuple[memoryview, bytearray]:
        """A whole bulk message (HEAD, lengths, each frame encrypted and tagged under a counter
        used once) written into a buffer of `pool`: the message's bytes, and that buffer."""
        self.sent += 1
        plain = [_bytes(frame) for frame in frames]
        lengths = [len(frame) + TAG_BYTES for frame in plain]
        head = framing.HEAD.size + framing.LENGTH.size * len(lengths)
        buffer = pool.get(head + framing.HEAD_TAG + sum(lengths))
        out = memoryview(buffer)
        offset = framing.pack_head(self.id, self.sent, lengths, out)
        out[offset:offset + framing.HEAD_TAG] = self.head_tag(direction, self.sent, out[:offset])
        offset += framing.HEAD_TAG
        aad = _aad(PREFIX.pack(self.id, self.sent), direction, len(plain))
        for i, frame in enumerate(plain):
            self._aead.encrypt_into(NONCE.pack(direction, i, self.sent), frame, aad, out[offset:offset + lengths[i]])
            offset += lengths[i]
        self.volume += sum(lengths) - TAG_BYTES * len(lengths)
        return out[:offset], buffer

    def head_tag(self, direction: int, counter: int, head: Frame) -> bytes:
        """The tag of a message's HEAD and lengths: so a receiver knows they are the sender's
        before it takes a buffer for the frames they announce."""
        return self._aead.encrypt(NONCE.pack(direction, HEAD_INDEX, counter), b"", bytes(head))

    def check_head(self, direction: int, head: bytes, tag: bytes) -> None:
        """BulkRejected unless `head` (HEAD and lengths) is a fresh one of this session, with its tag."""
        session_id, counter, _ = framing.HEAD.unpack_from(head)
        counter = self.counter_of(PREFIX.pack(session_id, counter))
        try:
            self._aead.decrypt(NONCE.pack(direction, HEAD_INDEX, counter), tag, head)
        except InvalidTag as exc:
            raise errors.BulkRejected("a message head that failed its authentication tag") from exc

    def counter_of(self, prefix: Frame) -> int:
        """The counter of a message of this session; BulkRejected if it is not above the last taken."""
        if len(prefix) != PREFIX.size:
            raise errors.BulkRejected("no session prefix")
        session_id, counter = PREFIX.unpack(prefix)
        if session_id != self.id:
            raise errors.BulkRejected("a message of another session")
        if counter <= self.accepted:
            raise errors.BulkRejected("a replayed or reordered message (its counter was taken before)")
        return counter

    def open(self, direction: int, prefix: Frame, counter: int, index: int, count: int, sealed: Frame,
             into: memoryview | None = None) -> Frame:
        """Frame `index` of `count` decrypted (into `into` when given, which must be its exact
        size); BulkRejected when its tag does not check. Call accept(counter) once all are open."""
        nonce, aad = NONCE.pack(direction, index, counter), _aad(prefix, direction, count)
        self.volume += len(sealed)
        try:
            if into is None:
                return self._aead.decrypt(nonce, sealed, aad)
            self._aead.decrypt_into(nonce, sealed, aad, into)
            return into
        except (InvalidTag, ValueError) as exc:
            raise errors.BulkRejected("a frame failed its authentication tag (forged, altered or moved)") from exc

    def accept(self, counter: int) -> None:
        self.accepted = counter


def _bytes(frame: Frame) -> Frame:
    """The cipher takes byte buffers: a float32 array's memoryview is cast to bytes."""
    return frame.cast("B") if isinstance(frame, memoryview) and frame.format != "B" else frame


def _aad(prefix: Frame, direction: int, count: int) -> bytes:
    return bytes(prefix) + bytes((direction, count))


def _hello_aad(session_id: bytes, counter: int) -> bytes:
    return framing.HELLO_MAGIC + PREFIX.pack(session_id, counter)


def open_request(session: Session, message: framing.Message) -> list[memoryview]:
    """Every frame of a bulk request decrypted into one fresh buffer (the shard may keep
    its arrays past the request); BulkRejected, with nothing taken, if any fails."""
    counter, sealed = session.counter_of(message.prefix), message.frames()
    if any(len(frame) < TAG_BYTES for frame in sealed):
        raise errors.BulkRejected("a frame shorter than its tag")
    plain = memoryview(bytearray(sum(len(frame) - TAG_BYTES for frame in sealed)))
    frames, offset = [], 0
    for index, frame in enumerate(sealed):
        into = plain[offset:offset + len(frame) - TAG_BYTES]
        frames.append(session.open(TO_SERVER, message.prefix, counter, index, len(sealed), frame, into=into))
        offset += len(into)
    session.accept(counter)
    return frames


def open_reply(session: Session, message: framing.Message,
               sink: Callable[[memoryview, int], "np.ndarray | None"] | None
               ) -> tuple[memoryview, list[memoryview], int]:
    """A bulk reply decrypted, as interface.Received's fields: its header frame, then each
    frame into the array sink(header, index) names when its size is that array's (a pull
    lands in place), else as bytes. BulkRejected, with nothing taken, if the counter or any tag
    fails (the sink's array may then hold garbage, which the request's resend overwrites)."""
    prefix, sealed = message.prefix, message.frames()
    counter, count = session.counter_of(prefix), len(sealed)
    header = memoryview(session.open(TO_CLIENT, prefix, counter, 0, count, sealed[0]))
    frames: list[memoryview] = []
    into_sink = 0
    for index, frame in enumerate(sealed[1:]):
        target = sink(header, index) if sink is not None else None
        exact = target is not None and target.nbytes == len(frame) - TAG_BYTES
        into = memoryview(target).cast("B") if exact else None  # an array not in one piece: TypeError
        plain = session.open(TO_CLIENT, prefix, counter, index + 1, count, frame, into=into)
        if target is None:
            frames.append(memoryview(plain))
        else:  # a size other than the array's is counted, not copied: the caller refuses it
            into_sink += len(plain)
    session.accept(counter)
    return header, frames, into_sink


def parse_grant(frame: Frame) -> tuple[Session, int] | None:
    """The client's session and the bulk port from a SESSION reply; None if it is not one."""
    if len(frame) != GRANT.size:
        return None
    magic, session_id, key, port = GRANT.unpack(frame)
    return (Session(id=session_id, key=key), port) if magic == SESSION_MAGIC else None


class Table:
    """A server's sessions, bounded per peer and in total (the least recently used goes
    first), and which session each peer's replies go by. Looking a session up is all the
    work an unknown id costs."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, max_per_peer: int = MAX_PER_PEER) -> None:
        self.max_sessions, self.max_per_peer = max_sessions, max_per_peer
        self._sessions: collections.OrderedDict[bytes, Session] = collections.OrderedDict()
        self._routes: dict[bytes, Session] = {}  # peer -> the session its last request came by
        self._owners: collections.Counter[tuple[str | None, bytes]] = collections.Counter()  # sessions of each

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, user: str | None, peer: bytes, port: int) -> bytes:
        """A new session for this peer (its ZAP user and routing id): the SESSION reply."""
        mine = [s for s in self._sessions.values() if s.owner == (user, peer)]
        for old in mine[:max(0, len(mine) - self.max_per_peer + 1)]:
            self._drop(old)
        session = Session(id=os.urandom(ID_BYTES), key=os.urandom(KEY_BYTES), user=user, peer=peer)
        self._sessions[session.id] = session
        self._owners[session.owner] += 1
        while len(self._sessions) > self.max_sessions:
            self._drop(next(iter(self._sessions.values())))
        return GRANT.pack(SESSION_MAGIC, session.id, session.key, port)

    def _drop(self, session: Session) -> None:
        del self._sessions[session.id]
        self._owners[session.owner] -= 1
        if not self._owners[session.owner]:
            del self._owners[session.owner]
        if self._routes.get(session.peer) is session:
            del self._routes[session.peer]

    def knows(self, owner: object) -> bool:
        """Whether a session of this peer (its ZAP user and routing id) is still held."""
        return owner in self._owners

    def find(self, session_id: bytes) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise errors.BulkRejected("an unknown session")
        self._sessions.move_to_end(session.id)
        return session

    def route(self, session: Session, route: Any) -> None:
        """session's peer sent its last request by it, on the bulk connection `route`."""
        session.route = route
        self._routes[session.peer] = session

    def routed(self, peer: bytes) -> Session | None:
        return self._routes.get(peer)

    def unroute(self, peer: bytes) -> None:
        self._routes.pop(peer, None)


class RefusalLog:
    """At most one warning line per reason every REFUSAL_LOG_SECONDS: anyone can send
    junk to a bulk port, and must not flood the log by it."""

    def __init__(self, who: str) -> None:
        self.who = who
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (last logged, refused since)

    def refused(self, reason: str) -> None:
        now = time.monotonic()
        last, since = self._logged.get(reason, (float("-inf"), 0))
        if now - last >= REFUSAL_LOG_SECONDS:
            log.warning("event=bulk_refused server=%r reason=%r refused=%d", self.who, reason, since + 1)
            self._logged[reason] = (now, 0)
        else:
            self._logged[reason] = (last, since + 1)
