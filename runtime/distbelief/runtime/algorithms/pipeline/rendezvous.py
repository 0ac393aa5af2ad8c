"""Beside shard 0: replica groups formed from anonymous partition pods.

Each partition's pods come from their own Deployment, so no pod knows its group's other
pods in advance. A pod asks JOIN_GROUP with its partition and the address its stage serves on;
once every partition has a pod waiting, the oldest waiting pod of each forms a group, and
each is told its group's id and its neighbours' addresses. A member asks JOIN_GROUP again with
its group's id at least every HEARTBEAT_SECONDS, as a heartbeat.

A pod is its connection, not what it claims: the rendezvous knows each pod by the peer
identity the transport gives its requests (the authenticated user and the connection's
random routing id, which a pod's link keeps across reconnects), as the shards know their
peers for resends. The address a pod names is only where its neighbours will reach it:
an address that another connection already holds (waiting or in a group) is not taken
(the asker waits), so no other key holder can act for a member by naming its address.

A group dissolves when one of its members asks JOIN_GROUP, over its own connection, without
the group (its step failed: a neighbour died or refused) or for another partition or
address, or stays silent for GROUP_LEASE_SECONDS (it died where no neighbour could notice).
The others hear so at their next heartbeat, and wait again. Group ids come from
`secrets`, so a pod of a group from before a restart of shard 0 cannot pass for a member of
a new one, and no one can guess a group it was not told of.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from distbelief.runtime import errors, keys
from distbelief.runtime.algorithms.pipeline.ops import JOIN_GROUP
from distbelief.runtime.transport import fanout, interface, zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Header, Status

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0
GROUP_LEASE_SECONDS = 15.0
WAITING_LEASE_SECONDS = 3.0   # a waiting pod asks again every WAIT_POLL_SECONDS
WAIT_POLL_SECONDS = 0.2
MAX_ADDRESS = 256
POLL_SECONDS = 0.1
Peer = tuple  # (authenticated user or None, the connection's routing id): interface.Incoming's
# Ask again on a fresh connection after 5 s; never give up: shard 0 may be restarting.
JOIN_POLICY = fanout.RetryPolicy(attempt=5.0, give_up=None, resend_on_disconnect=False)


@dataclasses.dataclass
class Group:
    id: int
    peers: list[Peer]           # the members' connections, by partition
    members: list[str]          # their addresses, by partition
    seen: list[float]           # when each member last asked
    told: list[bool]            # whether each member has heard of the group yet

    def view(self, partition: int) -> dict[str, Any]:
        """What member `partition` is told: the group and its neighbours."""
        last = len(self.members) - 1
        return {"group": self.id,
                "upstream": self.members[partition - 1] if partition > 0 else None,
                "downstream": self.members[partition + 1] if partition < last else None}


class Groups:
    """The book-keeping of the rendezvous (no I/O): who waits, who is in which group."""

    def __init__(self, partitions: int) -> None:
        self.partitions = partitions
        # by partition: the waiting pods' connections -> (their addresses, when they last asked)
        self.waiting: list[OrderedDict[Peer, tuple[str, float]]] = [OrderedDict() for _ in range(partitions)]
        self.groups: dict[int, Group] = {}
        self.member_of: dict[Peer, Group] = {}
        self.formed = self.dissolved = self.refused = 0

    def join(self, peer: Peer, address: str, partition: int, group: int, now: float) -> dict[str, Any] | None:
        """The JOIN_GROUP of the pod on connection `peer`: its group's view, or None while it
        waits (or while another connection holds the address it names)."""
        self.expire(now)
        current = self.member_of.get(peer)
        if current is not None:
            slot = current.peers.index(peer)
            same = slot == partition and current.members[slot] == address
            if same and (current.id == group or (group == 0 and not current.told[slot])):
                return self._tell(current, slot, now)  # a heartbeat, or a waiting pod hearing its new group
            self._dissolve(current, f"member {current.members[slot]} left it")
        holder = self.holder(address)
        if holder is not None and holder != peer:
            self.refused += 1
            log.debug("event=join_refused address=%r reason=held_by_another_connection", address)
            return None
        for waiting in self.waiting:
            waiting.pop(peer, None)  # a pod that moved to another partition is waiting only there
        self.waiting[partition][peer] = (address, now)
        self._form(now)
        formed = self.member_of.get(peer)
        return self._tell(formed, partition, now) if formed is not None else None

    def holder(self, address: str) -> Peer | None:
        """The connection that holds address, waiting or in a group; None if none does."""
        for waiting in self.waiting:
            for peer, (held, _) in waiting.items():
                if held == address:
                    return peer
        for group in self.groups.values():
            if address in group.members:
                return group.peers[group.members.index(address)]
        return None

    @staticmethod
    def _tell(group: Group, partition: int, now: float) -> dict[str, Any]:
        group.seen[partition], group.told[partition] = now, True
        return group.view(partition)

    def expire(self, now: float) -> None:
        for waiting in self.waiting:
            for peer in [p for p, (_, seen) in waiting.items() if now - seen > WAITING_LEASE_SECONDS]:
                del waiting[peer]
        for group in list(self.groups.values()):
            silent = [m for m, seen in zip(group.members, group.seen) if now - seen > GROUP_LEASE_SECONDS]
            if silent:
                self._dissolve(group, f"member {silent[0]} silent for {GROUP_LEASE_SECONDS:.0f} s")

    def _form(self, now: float) -> None:
        while all(self.waiting):
            peers, claims = zip(*(waiting.popitem(last=False) for waiting in self.waiting))
            members = [address for address, _ in claims]
            group = Group(id=new_group_id(), peers=list(peers), members=members, seen=[now] * self.partitions,
                          told=[False] * self.partitions)
            self.groups[group.id] = group
            self.member_of.update({p: group for p in peers})
            self.formed += 1
            log.info("event=group_formed group=%016x members=%s", group.id, ",".join(members))

    def _dissolve(self, group: Group, why: str) -> None:
        del self.groups[group.id]
        for peer in group.peers:
            if self.member_of.get(peer) is group:
                del self.member_of[peer]
        self.dissolved += 1
        log.info("event=group_dissolved group=%016x reason=%r", group.id, why)


def new_group_id() -> int:
    """A group's id: odd (0 means none), from 63 unpredictable bits."""
    return secrets.randbits(63) | 1


class Rendezvous:
    """The JOIN_GROUP server beside shard 0 (a thread), on the coordinator port."""

    def __init__(self, bind: str, partitions: int, layout: int, *, security: keys.ServerSecurity | None,
                 finished: Callable[[], bool], transport_: interface.Transport | None = None) -> None:
        self.groups = Groups(partitions)
        self.layout, self.finished = layout, finished
        self.failure: BaseException | None = None
        self._transport = transport_ or zmq_transport.default()
        self._server = self._transport.server(bind, who="the rendezvous", max_frame=protocol.max_frame_bytes(0),
                                              max_frames=2, security=security)
        self.endpoint = self._server.endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rendezvous", daemon=True)
        log.info("event=rendezvous_listening address=%s partitions=%d", self.endpoint, partitions)

    def start(self) -> "Rendezvous":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._server.poll(POLL_SECONDS):
                    self._handle(self._server.receive())
        except Exception as exc:  # recorded for the role to report; the shard keeps its own state
            log.exception("event=rendezvous_failed error=%r", str(exc))
            self.failure = exc
        finally:
            self._server.close()

    def _handle(self, incoming: interface.Incoming | None) -> None:
        try:
            if incoming is None or not incoming.frames:
                raise errors.ProtocolError("an empty message or one with too many frames")
            request = protocol.parse_request(incoming.frames)
            if request.spec is not JOIN_GROUP or request.header.layout != self.layout:
                raise errors.ProtocolError("expected a JOIN_GROUP for this job's layout")
            address, partition, group = self._fields(request.meta.value)
        except errors.ProtocolError as exc:
            log.warning("event=rejected role=rendezvous reason=%r", str(exc))
            return
        if self.finished():
            self._reply(incoming.peer, request.header, Status.DONE)
            return
        view = self.groups.join((incoming.user, incoming.peer), address, partition, group, time.monotonic())
        self._reply(incoming.peer, request.header, Status.WAIT if view is None else Status.OK, view)

    def _fields(self, value: dict) -> tuple[str, int, int]:
        address, partition, group = value.get("address"), value.get("partition"), value.get("group", 0)
        if not isinstance(address, str) or not 0 < len(address) <= MAX_ADDRESS:
            raise errors.ProtocolError(f"JOIN_GROUP needs an address of 1..{MAX_ADDRESS} characters")
        if not isinstance(partition, int) or not 0 <= partition < self.groups.partitions:
            raise errors.ProtocolError(f"JOIN_GROUP's partition must be within 0..{self.groups.partitions - 1}")
        if not isinstance(group, int) or not 0 <= group < 2**63:
            raise errors.ProtocolError("JOIN_GROUP's group must be a group id or 0")
        return address, partition, group

    def _reply(self, peer: bytes, header: Header, status: int, view: dict | None = None) -> None:
        meta = protocol.JsonObject(view) if view is not None else None
        if not self._server.send(peer, protocol.reply_frames(header, step=0, status=status, meta=meta)):
            log.warning("event=reply_dropped role=rendezvous")


class RendezvousLink:
    """A partition pod's channel to the rendezvous."""

    def __init__(self, address: str, *, partition: int, me: str, worker_id: int, layout: int,
                 security: dict | None, stop: threading.Event, transport_: interface.Transport | None = None) -> None:
        self.partition, self.me, self.worker_id, self.layout, self.stop = partition, me, worker_id, layout, stop
        self._transport = transport_ or zmq_transport.default()
        self._link = self._transport.link(address, security, watch=False)
        self._name = f"the rendezvous at {address}"
        self._seq = 0

    def ask(self, group: int = 0) -> tuple[int, dict | None]:
        """One JOIN_GROUP (with group: a heartbeat): (status, the group's view or None)."""
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        header = Header(op=JOIN_GROUP.code, shard=0, layout=self.layout, seq=self._seq, worker=self.worker_id)
        request = protocol.JsonObject({"address": self.me, "partition": self.partition, "group": group})
        answers: list[tuple[int, dict | None]] = []

        def accept(_: int, received: interface.Received) -> bool:
            answer = protocol.unpack_header(received.header)
            if answer.seq != self._seq:
                return False
            view = protocol.JsonObject.unpack(received.frames[0]).value if answer.status == Status.OK else None
            if answer.status == Status.OK and not isinstance(view.get("group"), int):
                raise errors.ProtocolError("the rendezvous answered without a group")
            answers.append((answer.status, view))
            return True

        exchange = fanout.Exchange([self._link], [[header.pack(), request.pack()]], JOIN_POLICY, [self._name])
        fanout.exchange(self._transport, exchange, accept=accept, stop=self.stop)
        return answers[0]

    def wait_for_group(self) -> dict | None:
        """Ask until a group forms; None when the job is done."""
        while True:
            status, view = self.ask()
            if status == Status.DONE:
                return None
            if status == Status.OK:
                return view
            if self.stop.wait(WAIT_POLL_SECONDS):
                raise errors.Stopped("stopped while waiting for a group")

    def close(self) -> None:
        self._link.close()
