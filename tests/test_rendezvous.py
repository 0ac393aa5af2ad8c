"""The rendezvous beside shard 0: groups of one pod per partition, heartbeats, dissolution."""

from __future__ import annotations

import random
import threading

import pytest

from distbelief.runtime import errors
from distbelief.runtime.algorithms.pipeline import rendezvous
from distbelief.runtime.algorithms.pipeline.ops import JOIN_GROUP
from distbelief.runtime.algorithms.pipeline.rendezvous import Groups, Rendezvous, RendezvousLink
from distbelief.runtime.transport import zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Header, Status


def test_a_group_forms_once_every_partition_has_a_pod_waiting() -> None:
    groups = Groups(3, random.Random(1))
    assert groups.join("a0", 0, 0, now=0.0) is None
    assert groups.join("a1", 1, 0, now=0.1) is None
    view = groups.join("a2", 2, 0, now=0.2)
    assert view["upstream"] == "a1" and view["downstream"] is None
    first = groups.join("a0", 0, 0, now=0.3)  # still polling: hears its new group
    assert first["group"] == view["group"] and first["upstream"] is None and first["downstream"] == "a1"
    assert groups.join("a1", 1, 0, now=0.3) == {"group": view["group"], "upstream": "a0", "downstream": "a2"}


def test_the_oldest_waiting_pods_form_the_next_group() -> None:
    groups = Groups(2)
    for address, at in (("x0", 0.0), ("y0", 0.1)):
        groups.join(address, 0, 0, now=at)
    view = groups.join("x1", 1, 0, now=0.2)
    assert view["upstream"] == "x0"
    assert list(groups.waiting[0]) == ["y0"]


def test_a_member_asking_without_its_group_dissolves_it_and_waits_again() -> None:
    groups = Groups(2)
    groups.join("p0", 0, 0, now=0.0)
    view = groups.join("p1", 1, 0, now=0.0)
    groups.join("p0", 0, 0, now=0.1)            # told
    assert groups.join("p0", 0, view["group"], now=0.5)["group"] == view["group"]  # heartbeat
    assert groups.join("p0", 0, 0, now=1.0) is None  # its step failed: it leaves
    assert groups.dissolved == 1 and "p1" not in groups.member_of
    assert groups.join("p1", 1, view["group"], now=1.1)["group"] != view["group"]  # p1 re-forms with p0


def test_a_silent_member_dissolves_its_group_after_the_lease() -> None:
    groups = Groups(2)
    groups.join("p0", 0, 0, now=0.0)
    view = groups.join("p1", 1, 0, now=0.0)
    groups.join("p0", 0, 0, now=0.0)
    late = rendezvous.GROUP_LEASE_SECONDS + 1
    assert groups.join("p1", 1, view["group"], now=late) is None  # p0 said nothing all along
    assert groups.dissolved == 1 and list(groups.waiting[1]) == ["p1"]


def test_a_waiting_pod_that_stops_asking_is_forgotten() -> None:
    groups = Groups(2)
    groups.join("gone", 0, 0, now=0.0)
    assert groups.join("p1", 1, 0, now=rendezvous.WAITING_LEASE_SECONDS + 1) is None
    assert not groups.waiting[0]


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
    assert list(live.groups.waiting[0]) == ["this-model"]
    link.close()
