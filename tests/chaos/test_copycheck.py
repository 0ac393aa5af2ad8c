"""The copies checker (benchmarks/copycheck.py): its verdict on made-up histories, its
network faults on a socket, and seeded runs of local jobs with backups under faults
(SIGKILL, SIGSTOP, delays, one-way partitions, cut connections), each of which must end with
no acknowledged push lost, none applied twice, the shards' steps in agreement and never
going back. make bench runs more of them (docs/reliability.md has the figures)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import numpy as np
import pytest

from distbelief.runtime.params.rows.rowcheckpoint import key_parts
from distbelief.runtime.shard.checkpoint import Checkpoint

from support.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import copycheck
import copyverdict
import netfault
from copyverdict import Op


def ops(*specs: tuple[int, float, float, bool, list[int] | None]) -> list[Op]:
    return [Op(id=i, start=s, end=e, acked=a, steps=st) for i, s, e, a, st in specs]


def test_an_acknowledged_push_missing_from_a_shard_is_lost_and_one_applied_twice_is_duplicated() -> None:
    history = ops((0, 0, 1, True, [1, 1]), (1, 1, 2, True, [2, 2]), (2, 2, 3, False, None), (3, 2, 3, False, None))
    counts = np.array([[1, 0, 1, 0, 0, 2],
                       [1, 1, 0, 0, 0, 0]])
    v = copyverdict.verdict(history, counts, steps=[2, 2], limit=6)
    assert v["lost"]["ids"] == [1]          # acknowledged, missing on shard 0
    assert v["partial"]["ids"] == [2]       # indeterminate, applied on one shard: allowed
    assert v["duplicated"]["ids"] == [5] and v["phantom"]["ids"] == [5]
    assert v["steps_match_applied"] == [False, True] and not v["ok"]
    assert v["lost_by_shard"] == [1, 0]
    clean = copyverdict.verdict(history[:2], np.array([[1, 1, 0], [1, 1, 0]]), steps=[2, 2], limit=3)
    assert clean["ok"], clean


def test_copies_compare_rows_by_key_and_not_when_each_last_touched_them() -> None:
    def saved(keys: list[int], values: list[float], accumulators: list[float], touched: list[float]) -> Checkpoint:
        arrays = {"params": np.ones(3, np.float32), "sparse.keys": key_parts(np.array(keys, np.int64)).ravel(),
                  "sparse.values": np.repeat(np.array(values, np.float32), 2),  # rows of dim 2
                  "sparse.accumulators": np.array(accumulators, np.float32),
                  "sparse.touched": np.array(touched, np.float32)}
        return Checkpoint(step=5, layout=0, shard=0, arrays=arrays)

    def same(a: Checkpoint, b: Checkpoint) -> bool:
        x, y = copycheck.training_state(a), copycheck.training_state(b)
        return x.keys() == y.keys() and all(np.array_equal(x[name], y[name]) for name in x)

    one = saved([7, 2**40 + 3], [1.0, 2.0], [0.5, 0.25], [0.0, 1.0])
    assert same(one, saved([2**40 + 3, 7], [2.0, 1.0], [0.25, 0.5], [3.0, 9.0]))  # other order, other times
    assert not same(one, saved([7, 2**40 + 3], [1.0, 2.0], [0.5, 0.3], [0.0, 1.0]))
    assert not same(one, saved([7, 2**40 + 4], [1.0, 2.0], [0.5, 0.25], [0.0, 1.0]))


def test_adagrad_applications_are_read_back_from_how_far_a_coordinate_moved() -> None:
    moved = np.array([0.0, 1.0, 1 + 2 ** -0.5, 1 + 2 ** -0.5 + 3 ** -0.5, 0.2], dtype=np.float32)
    assert copycheck.applications(moved, "adagrad").tolist() == [0, 1, 2, 3, 0]
    assert copycheck.applications(moved, "sgd").tolist() == [0, 1, 2, 2, 0]


def test_a_held_step_applied_on_some_shards_only_or_applied_though_refused_breaks_atomicity() -> None:
    history = ops((0, 0, 1, True, None), (1, 1, 2, False, None), (2, 2, 3, False, None))
    history[2].refused = True
    counts = np.array([[1, 1, 1],
                       [1, 0, 1]])
    v = copyverdict.verdict(history, counts, steps=[3, 2], limit=3, atomic=True)
    assert v["half_applied"]["ids"] == [1] and v["applied_though_refused"]["ids"] == [2] and not v["ok"]
    assert copyverdict.verdict(history, counts, steps=[3, 2], limit=3)["half_applied"]["count"] == 0
    history[2].refused = False
    even = np.array([[1, 0, 1], [1, 0, 1]])
    assert copyverdict.verdict(history, even, steps=[2, 2], limit=3, atomic=True)["ok"]


def test_a_step_below_one_acknowledged_before_the_push_began_went_back() -> None:
    history = ops((0, 0.0, 1.0, True, [5, 5]), (1, 2.0, 3.0, True, [4, 7]), (2, 0.5, 1.5, True, [3, 6]))
    found = copyverdict.went_back(history, shards=2)
    assert found == [{"id": 1, "shard": 0, "step": 4, "seen_before": 5}]  # id 2 overlapped id 0: not ordered


def read(start: float, end: float, *shown: list[int]) -> copyverdict.Read:
    """A pull of two shards that showed push ids shown[s] applied once on shard s."""
    counts = np.zeros((len(shown), 4), np.int16)
    for shard, ids in enumerate(shown):
        counts[shard, ids] = 1
    return copyverdict.Read(start, end, [len(ids) for ids in shown], counts)


def test_a_read_missing_a_push_acknowledged_or_shown_before_it_began_is_stale_or_went_back() -> None:
    history = ops((0, 0.0, 1.0, True, [1, 1]), (1, 2.0, 3.0, True, [2, 2]), (2, 2.5, 6.0, True, [3, 3]))
    final = np.ones((2, 4), np.int64)
    final[:, 3] = 0
    reads = [read(1.5, 1.8, [0], [0]),              # after push 0's acknowledgement: holds it
             read(4.0, 4.5, [0], [0, 1]),           # push 1 acknowledged at 3.0, missing on shard 0: stale
             read(2.6, 5.0, [0, 1, 2], [0, 1, 2]),  # push 2 in flight: may show it
             read(5.5, 5.8, [0, 1], [0, 1, 2]),     # shard 0 lost push 2, shown by the read that ended at 5.0
             read(7.0, 7.1, [0, 1, 2, 3], [0, 1, 2])]  # push 3 never held at the end: dirty
    v = copyverdict.reads_verdict(reads, history, final)
    assert v["reads"] == 5 and not v["ok"]
    assert v["stale"]["by_shard"] == [1, 0] and v["stale"]["first"][0]["ids"] == [1]
    assert v["went_back"]["by_shard"] == [1, 0] and v["went_back"]["first"][0]["ids"] == [2]
    assert v["dirty"]["by_shard"] == [1, 0] and v["dirty"]["first"][0]["ids"] == [3]
    assert v["torn"]["count"] == 0
    assert copyverdict.reads_verdict(reads[:1] + reads[2:3], history, final)["ok"]


def test_a_read_whose_step_is_not_the_pushes_it_shows_is_torn() -> None:
    torn = read(1.5, 1.8, [0], [0])
    torn.steps = [1, 2]
    v = copyverdict.reads_verdict([torn], ops((0, 0.0, 1.0, True, [1, 1])), np.ones((2, 4), np.int64))
    assert v["torn"]["by_shard"] == [0, 1] and not v["ok"]
    assert copycheck.reads_unexplained(v, told=[0, 5]) == ["torn on shard 1"]


def test_read_findings_on_a_shard_that_reported_a_loss_are_explained_by_it() -> None:
    v = {kind: {"by_shard": [0, 0]} for kind in copyverdict.READ_FINDINGS}
    v["stale"]["by_shard"] = [0, 2]
    assert copycheck.reads_unexplained(v, told=[0, 3]) == []
    assert copycheck.reads_unexplained(v, told=[3, 0]) == ["stale on shard 1"]


def test_a_push_acknowledged_once_the_view_store_was_gone_for_a_lease_is_flagged() -> None:
    outage = {"kind": "store", "began": 100.0, "ended": 110.0}
    history = ops((1, 99.0, 102.0, True, [1, 1]),     # within the lease: the primary may still answer
                  (2, 104.0, 105.5, True, [2, 2]),    # a lease and the slack after the store went: flagged
                  (3, 104.0, 111.0, True, [3, 3]),    # answered after the store came back
                  (4, 104.0, 106.0, False, None))     # not acknowledged
    assert copycheck.acked_in_outages(history, [outage, {"kind": "kill"}]) == [2]
    assert copycheck.acked_in_outages(history, [{"kind": "kill"}]) == []


def test_rows_are_counted_by_how_far_sgd_moved_them() -> None:
    initial = np.zeros((5, 3), np.float32)
    final = initial + np.array([0.0, 1.0, 2.0, 0.3, 1.0], np.float32)[:, None]
    final[4, 0] = 2.0  # not every value of the row moved alike
    assert copyverdict.row_counts(initial, final).tolist() == [0, 1, 2, -1, -1]


def test_the_proxy_delays_holds_and_cuts_one_direction_at_a_time() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: _echo(server), daemon=True).start()
    net = netfault.Net().start()
    try:
        link = net.proxy(server.getsockname()[1])
        client = socket.create_connection((link.host, link.port), timeout=5)
        client.sendall(b"a")
        assert client.recv(10) == b"a"
        link.up.delay = 0.3
        sent = time.monotonic()
        client.sendall(b"b")
        assert client.recv(10) == b"b" and time.monotonic() - sent >= 0.3
        link.heal()
        link.down.blocked = True
        client.sendall(b"c")
        client.settimeout(0.5)
        with pytest.raises(TimeoutError):
            client.recv(10)
        link.down.blocked = False
        client.settimeout(5)
        assert client.recv(10) == b"c"
        link.reset()
        assert client.recv(10) == b""
    finally:
        net.stop()
        server.close()


def _echo(server: socket.socket) -> None:
    while True:
        try:
            connection, _ = server.accept()
        except OSError:
            return
        threading.Thread(target=lambda c=connection: [c.sendall(d) for d in iter(lambda: c.recv(65536), b"")],
                         daemon=True).start()


RUNS = [copycheck.Plan(kind="dense", backups=2, seed=31, seconds=10.0, faults=("stall",),
                       stall_seconds=(7.0, 7.0), target="backup", pause=(1.0, 1.0)),
        copycheck.Plan(kind="dense", backups=1, seed=11, seconds=15.0),
        copycheck.Plan(kind="sparse", backups=1, seed=12, seconds=15.0),
        copycheck.Plan(kind="partitioned", backups=1, seed=13, seconds=15.0),
        copycheck.Plan(kind="sparse", backups=2, seed=14, seconds=15.0),
        # the view store unreachable for 6 s (twice the lease): the shard's copies stop
        # acknowledging, then go on, whoever leads after
        copycheck.Plan(kind="dense", backups=1, seed=15, seconds=12.0, faults=("store",), outage_seconds=(6.0, 6.0),
                       pause=(1.0, 2.0))]


@pytest.mark.slow
@pytest.mark.parametrize("plan", RUNS, ids=lambda p: p.name + ("" if p.faults == copycheck.FAULTS else "-" + "-".join(p.faults)))
def test_copies_under_faults_lose_nothing_acknowledged_and_apply_nothing_twice(plan: copycheck.Plan) -> None:
    result = copycheck.run(plan)
    print(json.dumps({"plan": plan.name, "faults": result["faults"], "verdict": result["verdict"],
                      "rows": result.get("rows")}))
    verdict = result["verdict"]
    assert result["faults"], "the nemesis injected nothing"
    assert verdict["acknowledged"] > 100
    assert verdict["lost"]["count"] == 0 and verdict["duplicated"]["count"] == 0, verdict
    assert verdict["phantom"]["count"] == 0 and not verdict["went_back"], verdict
    assert all(verdict["steps_match_applied"]), verdict
    assert verdict["steps_agree"] or verdict["indeterminate"], verdict
    assert result.get("rows", {"ok": True})["ok"], result["rows"]
    assert result["settled"] and not result["copies_differ"], result
    assert result["bulk_connections"] > 0, "no copy forwarded over an AES-GCM session, through its proxy"
    assert not result["acked_in_outages"], result["acked_in_outages"]
    assert result["reads"]["reads"] > 5 and result["reads"]["ok"], result["reads"]
    assert result["ok"]


ANYTIME = copycheck.Plan(kind="dense", optimizer="adagrad", backups=1, seed=7, seconds=25.0, faults=("kill",),
                         pause=(0.5, 2.0), anytime=True)


@pytest.mark.slow
def test_kills_at_any_time_lose_nothing_silently_and_leave_the_copies_and_their_accumulators_equal() -> None:
    """SIGKILLs 0.5-2 s apart whatever the copies' state, on an Adagrad job at minInSync 1:
    what the rule lets go (a kill of the last copy in sync) must be reported by the shard,
    and nothing may be applied twice."""
    result = copycheck.run(ANYTIME)
    print(json.dumps(copycheck.brief(result)))
    verdict = result["verdict"]
    assert verdict["acknowledged"] > 100
    assert any(not fault["in_sync"] for fault in result["faults"]), "no kill came while a copy was out of sync"
    assert not result["lost_silently"], (verdict["lost_by_shard"], result["reported_lost"])
    assert verdict["duplicated"]["count"] == 0 and verdict["phantom"]["count"] == 0, verdict
    assert all(verdict["steps_match_applied"]), verdict
    assert result["settled"] and not result["copies_differ"], result
    assert not copycheck.reads_unexplained(result["reads"], result["reported_lost"]), result["reads"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_journal_without_copies_loses_nothing_acknowledged_under_kills_at_any_time(kind: str) -> None:
    """SIGKILLs 0.5-2 s apart of shards without backups, with spec.parameterServers.journal:
    every push a shard acknowledged (and with embeddings, every row update) is in its
    journal, and comes back when it restarts."""
    plan = copycheck.Plan(kind=kind, optimizer="adagrad", backups=0, journal=True, seed=8, seconds=25.0,
                          faults=("kill",), pause=(0.5, 2.0), anytime=True)
    result = copycheck.run(plan)
    print(json.dumps(copycheck.brief(result)))
    verdict = result["verdict"]
    assert len(result["faults"]) >= 5 and verdict["acknowledged"] > 100, (result["faults"], verdict["acknowledged"])
    assert verdict["lost"]["count"] == 0 and verdict["duplicated"]["count"] == 0, verdict
    assert verdict["phantom"]["count"] == 0 and not verdict["went_back"], verdict
    assert all(verdict["steps_match_applied"]), verdict
    assert result.get("rows", {"ok": True})["ok"], result["rows"]
    assert result["reported_lost"] == [0, 0] and result["settled"], result
    # a pull's reply waits for the disk too: no read showed what a restart did not bring back
    assert result["reads"]["reads"] > 5 and result["reads"]["ok"], result["reads"]

