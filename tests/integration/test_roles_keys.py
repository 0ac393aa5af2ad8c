"""Roles with their own keys: what a replica's key may not do, and who a peer is.

The attacker here holds the replicas' key (the strongest who is not the chief): it may
pull and push, but not end the job, not drive Sandblaster's iterations, and not pass for
another replica."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import prometheus_client as prom
import pytest

from distbelief.runtime import errors, keys
from distbelief.runtime.algorithms.sandblaster.ops import SandblasterShards, VectorCode, VectorCommand
from distbelief.runtime.algorithms.sandblaster.vectors import ShardVectors, Slots
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.params import dense
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.shard.copies import replication
from distbelief.runtime.shard.copies.viewstore import MemoryViewStore
from distbelief.runtime.shard.copies.watch import COPY_STATUS
from distbelief.runtime.shard.core import Shard, ShardSettings
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.layout import Layout

from support.memory import observed, rss_bytes
from support.shards import LiveShards, start_shards
from support.waiting import eventually

LAYOUT = Layout.of([("w", (6, 4))], shards=2)
TIMEOUTS = Timeouts(request=2.0, unavailable=5.0)


@pytest.fixture
def shards(tmp_path: Path, job_keys: keys.JobKeys, encrypted: bool) -> Iterator[LiveShards]:
    live = start_shards(tmp_path, LAYOUT, np.zeros(LAYOUT.total, np.float32), learning_rate=0.5,
                        security=job_keys.server_security(encrypted=encrypted), bulk_bind="tcp://127.0.0.1:*")
    yield live
    live.stop()


def _group(live: LiveShards, job_keys: keys.JobKeys, role: str, encrypted: bool, **kwargs) -> ShardGroup:
    return ShardGroup(live.addresses, LAYOUT, timeouts=TIMEOUTS,
                      security=job_keys.client_options(role=role, encrypted=encrypted), **kwargs)


def test_a_replica_s_key_cannot_end_the_job_but_the_chief_s_can(shards: LiveShards, job_keys: keys.JobKeys,
                                                                 encrypted: bool) -> None:
    replica = _group(shards, job_keys, keys.REPLICA, encrypted)
    chief = _group(shards, job_keys, keys.CHIEF, encrypted)
    try:
        with pytest.raises(errors.ShardRefused, match="DONE is the chief's to send"):
            replica.done("MaxStepsReached\nevent=forged", "Succeeded")
        assert all(s.finished is None for s in shards.shards)
        # it still trains
        Float32Dense(replica).push(np.ones(LAYOUT.total, np.float32), steps=[0, 0], examples=1, loss=1.0)
        assert all(r.done for r in chief.done("MaxStepsReached", "Succeeded"))
        assert all(s.finished["reason"] == "MaxStepsReached" for s in shards.shards)
    finally:
        replica.close()
        chief.close()


def test_a_forged_worker_id_and_seq_do_not_take_another_replica_s_push(shards: LiveShards, job_keys: keys.JobKeys,
                                                                        encrypted: bool) -> None:
    """The shard tells peers apart by their connection's routing id, not by the worker id
    they claim: the attacker's push under the victim's (worker, seq) is its own."""
    victim = _group(shards, job_keys, keys.REPLICA, encrypted, worker_id=7)
    attacker = _group(shards, job_keys, keys.REPLICA, encrypted, worker_id=7)
    try:
        attacker._seq = victim._seq  # the attacker's next request has the victim's next (worker, seq)
        Float32Dense(attacker).push(np.ones(LAYOUT.total, np.float32), steps=[0, 0], examples=1, loss=1.0)
        replies = Float32Dense(victim).push(np.ones(LAYOUT.total, np.float32), steps=[0, 0], examples=1, loss=1.0)
        assert [r.step for r in replies] == [2, 2]  # both applied: the victim's was not taken for a resend
    finally:
        victim.close()
        attacker.close()


def _sandblaster_shard(tmp_path: Path, security: keys.ServerSecurity) -> tuple[Shard, threading.Thread]:
    layout = Layout.of([("w", (8,))], shards=1)
    shard = Shard(ShardSettings(shard=0, bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path), security=security,
                                bulk_bind="tcp://127.0.0.1:*"), layout, ShardMetrics(prom.CollectorRegistry(), 0))
    dense = DenseSlice(shard, np.arange(8, dtype=np.float32), optimizer="adagrad", learning_rate=0.1, pushes=False)
    shard.attach(dense)
    shard.attach(ShardVectors(shard, dense, history=2))
    shard.restore()
    thread = threading.Thread(target=shard.serve, daemon=True)
    thread.start()
    assert shard.ready.wait(5)
    return shard, thread


@pytest.mark.parametrize("command", ["begin_evaluation", "vector", "commit", "rollback"])
def test_a_replica_s_key_cannot_drive_sandblaster(tmp_path: Path, job_keys: keys.JobKeys, encrypted: bool,
                                                  command: str) -> None:
    shard, thread = _sandblaster_shard(tmp_path, job_keys.server_security(encrypted=encrypted))
    layout = Layout.of([("w", (8,))], shards=1)
    replica = SandblasterShards(ShardGroup([shard.endpoint], layout, timeouts=TIMEOUTS,
                                           security=job_keys.client_options(encrypted=encrypted)))
    calls = {"begin_evaluation": lambda: replica.begin_evaluation(5, 2),
             "vector": lambda: replica.vector(VectorCommand(code=VectorCode.SCALE, out=Slots.X, scalar=0.0)),
             "commit": lambda: replica.commit(99, {"iteration": 99}),
             "rollback": lambda: replica.rollback(0)}
    try:
        with pytest.raises(errors.ShardRefused, match="is the chief's to send"):
            calls[command]()
        np.testing.assert_array_equal(shard.plugin(DenseSlice).params, np.arange(8))
        assert shard.step == 0 and os.listdir(tmp_path) == []  # nothing committed, nothing rolled back
    finally:
        replica.group.close()
        shard.stop()
        thread.join(5)


# -- the keys folder of local mode ------------------------------------------------------------


def test_a_keys_folder_open_to_others_or_holding_a_link_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    keys.ensure(str(folder))
    os.chmod(folder / keys.CLIENT_SECRET, 0o644)
    with pytest.raises(errors.ConfigError, match="client.secret is open to other users"):
        keys.ensure(str(folder))
    os.chmod(folder / keys.CLIENT_SECRET, 0o600)
    (folder / keys.SERVER_SECRET).unlink()
    (folder / keys.SERVER_SECRET).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(errors.ConfigError, match="server.secret is a symbolic link"):
        keys.ensure(str(folder))


def test_a_keys_folder_of_an_earlier_version_gets_the_chief_s_keypair(tmp_path: Path) -> None:
    made = keys.JobKeys.generate()
    keys.write_files(str(tmp_path), {name: text for name, text in made.files().items() if not name.startswith("chief")})
    upgraded = keys.ensure(str(tmp_path))
    assert (upgraded.server_secret, upgraded.client_secret) == (made.server_secret, made.client_secret)
    assert upgraded.chief_secret is not None and upgraded.chief_public not in (made.chief_public, None)
    upgraded._check_pairs(str(tmp_path))


def test_replies_a_peer_never_reads_do_not_pile_up(tmp_path: Path, job_keys: keys.JobKeys) -> None:
    """400 pulls of a 1 MB slice, none of them read: without a send high-water mark the
    shard would queue 400 MB of copies; with one it keeps a bounded few and drops the rest,
    and goes on serving others."""
    import zmq

    from distbelief.runtime.wire import protocol

    layout = Layout.of([("w", (250_000,))], shards=1)
    live = start_shards(tmp_path, layout, np.zeros(layout.total, np.float32),
                        security=job_keys.server_security())
    greedy = zmq.Context.instance().socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    greedy.setsockopt(zmq.RCVHWM, 1)  # it reads nothing, so what piles up piles up at the shard
    for option, value in job_keys.client_options().items():
        greedy.setsockopt(option, value)
    greedy.connect(live.addresses[0])
    group = live.group(security=job_keys.client_options())
    try:
        group.hello()  # the shard is up and admits the key
        before = rss_bytes()
        pull = protocol.Header(op=dense.PULL.code, shard=0, layout=layout.hash)
        for seq in range(400):
            greedy.send(dataclasses.replace(pull, seq=seq).pack())
        pulls = live.shards[0].metrics.request_seconds("PULL")
        eventually(lambda: observed(pulls) >= 400, 60, what="every pull answered (or dropped)")
        out = np.empty(layout.total, np.float32)
        assert [r.step for r in Float32Dense(group).pull(out)] == [0]  # and others are still served
        grown = rss_bytes() - before
        assert grown < 150 * 1024 * 1024, f"RSS grew by {grown} bytes"
    finally:
        greedy.close()
        group.close()
        live.stop()


@pytest.mark.parametrize("op", [replication.REPLICATE, replication.JOIN, replication.COPY_STATE, COPY_STATUS],
                         ids=lambda op: op.name)
def test_only_the_chief_s_key_reaches_a_shard_copy_s_own_ops(tmp_path: Path, job_keys: keys.JobKeys,
                                                             encrypted: bool, op: protocol.OpSpec) -> None:
    """Copies forward requests under their first sender's identity and hand over their whole
    state: a replica's key may do neither (the shards, which hold the chief's key, may)."""
    def with_copies(shard: Shard) -> None:
        shard.serve_copies(replication.Copies(shard, rank=0, addresses=[shard.settings.bind, "tcp://127.0.0.1:9"],
                                              security=None, store=MemoryViewStore()))

    live = start_shards(tmp_path, Layout.of([("w", (6, 4))], shards=1), np.zeros(24, np.float32),
                        attach=with_copies, security=job_keys.server_security(encrypted=encrypted))
    replica = ShardGroup(live.addresses, live.layout, timeouts=TIMEOUTS,
                         security=job_keys.client_options(role=keys.REPLICA, encrypted=encrypted))
    chief = ShardGroup(live.addresses, live.layout, timeouts=TIMEOUTS,
                       security=job_keys.client_options(role=keys.CHIEF, encrypted=encrypted))
    try:
        with pytest.raises(errors.ShardRefused, match=f"{op.name} is the chief's to send"):
            replica.request(op)
        if op is COPY_STATUS:
            (reply,) = chief.request(op)
            assert reply.meta.value["role"] == "syncing"
    finally:
        replica.close()
        chief.close()
        live.stop()
