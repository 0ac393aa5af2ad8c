"""The rendezvous beside shard 0: groups of one pod per partition, heartbeats, dissolution;
pods known by their connections, not by the addresses they name."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from distbelief.runtime import keys
from distbelief.runtime.algorithms.pipeline import commit, rendezvous
from distbelief.runtime.algorithms.pipeline.ops import JOIN_GROUP
from distbelief.runtime.algorithms.pipeline.rendezvous import Groups, Rendezvous, RendezvousLink
from distbelief.runtime.transport import zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Header, Status


def join(groups: Groups, name: str, partition: int, group: int = 0, *, now: float, address: str | None = None):
    """JOIN_GROUP from the connection called name (the replicas' one user, its own routing
    id), naming its own address unless told another."""
    return groups.join(("replicas", name.encode()), address or name, partition, group, now)


def waiting(groups: Groups, partition: int) -> list[str]:
    return [address for address, _ in groups.waiting[partition].values()]


def test_a_group_forms_once_every_partition_has_a_pod_waiting() -> None:
    groups = Groups(3)
    assert join(groups, "a0", 0, now=0.0) is None
    assert join(groups, "a1", 1, now=0.1) is None
    view = join(groups, "a2", 2, now=0.2)
    assert view["upstream"] == "a1" and view["downstream"] is None
    first = join(groups, "a0", 0, now=0.3)  # still polling: hears its new group
    assert first["group"] == view["group"] and first["upstream"] is None and first["downstream"] == "a1"
    assert join(groups, "a1", 1, now=0.3) == {"group": view["group"], "upstream": "a0", "downstream": "a2"}


def test_the_oldest_waiting_pods_form_the_next_group() -> None:
    groups = Groups(2)
    for address, at in (("x0", 0.0), ("y0", 0.1)):
        join(groups, address, 0, now=at)
    view = join(groups, "x1", 1, now=0.2)
    assert view["upstream"] == "x0"
    assert waiting(groups, 0) == ["y0"]


def test_a_member_asking_without_its_group_dissolves_it_and_waits_again() -> None:
    groups = Groups(2)
    join(groups, "p0", 0, now=0.0)
    view = join(groups, "p1", 1, now=0.0)
    join(groups, "p0", 0, now=0.1)            # told
    assert join(groups, "p0", 0, view["group"], now=0.5)["group"] == view["group"]  # heartbeat
    assert join(groups, "p0", 0, now=1.0) is None  # its step failed: it leaves
    assert groups.dissolved == 1 and not groups.member_of
    assert join(groups, "p1", 1, view["group"], now=1.1)["group"] != view["group"]  # p1 re-forms with p0


def test_a_silent_member_dissolves_its_group_after_the_lease() -> None:
    groups = Groups(2)
    join(groups, "p0", 0, now=0.0)
    view = join(groups, "p1", 1, now=0.0)
    join(groups, "p0", 0, now=0.0)
    late = rendezvous.GROUP_LEASE_SECONDS + 1
    assert join(groups, "p1", 1, view["group"], now=late) is None  # p0 said nothing all along
    assert groups.dissolved == 1 and waiting(groups, 1) == ["p1"]


def test_a_waiting_pod_that_stops_asking_is_forgotten() -> None:
    groups = Groups(2)
    join(groups, "gone", 0, now=0.0)
    assert join(groups, "p1", 1, now=rendezvous.WAITING_LEASE_SECONDS + 1) is None
    assert not groups.waiting[0]


def test_another_connection_naming_a_member_s_address_neither_dissolves_nor_joins_its_group() -> None:
    groups = Groups(2)
    join(groups, "p0", 0, now=0.0)
    view = join(groups, "p1", 1, now=0.0)
    join(groups, "p0", 0, now=0.0)
    for group in (0, view["group"]):  # even one that learnt the group's id
        assert join(groups, "hostile", 1, group, now=0.5, address="p1") is None
        assert join(groups, "hostile", 0, group, now=0.5, address="p0") is None
    assert groups.dissolved == 0 and groups.refused == 4
    assert join(groups, "p1", 1, view["group"], now=0.6) == view  # the members keep their group
    assert join(groups, "p0", 0, view["group"], now=0.6)["group"] == view["group"]
    assert not any(groups.waiting)


def test_an_address_is_free_again_once_its_holder_is_gone() -> None:
    """A restarted pod (a new connection at the old address) waits until the old
    connection's group dissolves, then joins under its new one."""
    groups = Groups(2)
    join(groups, "p0", 0, now=0.0)
    join(groups, "p1", 1, now=0.0)
    assert join(groups, "p1-restarted", 1, now=0.1, address="p1") is None
    assert groups.refused == 1 and waiting(groups, 1) == []
    join(groups, "p0", 0, now=0.2)                   # told
    assert join(groups, "p0", 0, now=0.3) is None    # its FORWARD to p1 broke: it leaves
    view = join(groups, "p1-restarted", 1, now=0.4, address="p1")
    assert view["upstream"] == "p0" and groups.member_of[("replicas", b"p1-restarted")].id == view["group"]


def test_a_member_that_names_another_partition_or_address_leaves_its_group() -> None:
    groups = Groups(2)
    join(groups, "p0", 0, now=0.0)
    view = join(groups, "p1", 1, now=0.0)
    assert join(groups, "p1", 1, view["group"], now=0.1, address="elsewhere") is None
    assert groups.dissolved == 1 and waiting(groups, 1) == ["elsewhere"]


def test_group_ids_are_unpredictable() -> None:
    ids = []
    for _ in range(2):
        random.seed(0)
        np.random.seed(0)
        groups = Groups(1)
        ids.append(join(groups, "p0", 0, now=0.0)["group"])
        ids.append(commit.new_token())
    assert ids[0] != ids[2] and ids[1] != ids[3]  # the same seeds: other ids and tokens
    assert all(0 < i < 2**64 for i in ids) and ids[0] % 2 == 1 and ids[0] < 2**63
    assert not hasattr(rendezvous, "random")  # no seeded generator behind the ids


@pytest.fixture
def live():
    server = Rendezvous("tcp://127.0.0.1:*", 2, layout=42, security=None, finished=lambda: False).start()
    yield server
    server.stop()


def test_pods_form_a_group_over_the_wire(live) -> None:
    stop = threading.Event()
    links = [RendezvousLink(live.endpoint, partition=k, me=f"tcp://pod{k}:1", worker_id=k, layout=42,
                            security=None, stop=stop) for k in range(2)]
    assert links[0].ask() == (Status.WAIT, None)
    status, view = links[1].ask()
    assert status == Status.OK and view["upstream"] == "tcp://pod0:1"
    assert links[0].wait_for_group()["downstream"] == "tcp://pod1:1"
    for link in links:
        link.close()


@pytest.mark.parametrize("value", [{"partition": 0}, {"address": "a", "partition": 2},
                                   {"address": "a", "partition": "0"}, {"address": "x" * 300, "partition": 0},
                                   {"address": "a", "partition": 0, "group": -1}])
def test_a_malformed_join_gets_no_group_and_the_rendezvous_keeps_serving(live, value) -> None:
    tp = zmq_transport.default()
    link = tp.link(live.endpoint, None, watch=False)
    header = Header(op=JOIN_GROUP.code, shard=0, layout=42, seq=1)
    link.send([header.pack(), protocol.JsonObject(value).pack()])
    assert not tp.wait([link], 0.5)  # dropped: nothing a pod could mistake for a group
    link.close()
    assert live.failure is None
    test_pods_form_a_group_over_the_wire(live)


def test_a_join_for_another_layout_is_dropped(live) -> None:
    tp = zmq_transport.default()
    link = tp.link(live.endpoint, None, watch=False)
    for seq, layout, address in ((1, 7, "other-model"), (2, 42, "this-model")):
        header = Header(op=JOIN_GROUP.code, shard=0, layout=layout, seq=seq)
        link.send([header.pack(), protocol.JsonObject({"address": address, "partition": 0}).pack()])
    assert tp.wait([link], 5.0)
    assert protocol.unpack_header(link.receive().header).seq == 2
    assert waiting(live.groups, 0) == ["this-model"]
    link.close()


def test_a_key_holder_naming_a_member_s_address_cannot_break_its_group_over_the_wire(
        job_keys: keys.JobKeys, encrypted: bool) -> None:
    """The replicas share one key, so the hostile peer is the same ZAP user as the members:
    only its connection tells it apart."""
    server = Rendezvous("tcp://127.0.0.1:*", 2, layout=42, security=job_keys.server_security(encrypted=encrypted),
                        finished=lambda: False).start()
    stop = threading.Event()
    options = job_keys.client_options(encrypted=encrypted)

    def link(partition: int, me: str) -> RendezvousLink:
        return RendezvousLink(server.endpoint, partition=partition, me=me, worker_id=partition, layout=42,
                              security=options, stop=stop)
    members, hostile = [link(0, "tcp://pod0:1"), link(1, "tcp://pod1:1")], link(1, "tcp://pod1:1")
    try:
        members[0].ask()
        group = members[1].wait_for_group()["group"]
        assert members[0].wait_for_group()["group"] == group
        assert hostile.ask() == (Status.WAIT, None)        # before: one such request dissolved the group
        assert hostile.ask(group) == (Status.WAIT, None)   # its id does not let it in either
        for member in members:
            status, view = member.ask(group)               # a heartbeat: the group stands
            assert status == Status.OK and view["group"] == group
        assert server.groups.dissolved == 0 and server.groups.refused == 2
    finally:
        for each in (*members, hostile):
            each.close()
        server.stop()
