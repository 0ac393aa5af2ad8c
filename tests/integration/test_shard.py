"""A live parameter shard on loopback: pulls, pushes, refusals, hostile input, completion,
checkpoints and warm-start, through the real ZeroMQ protocol."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import prometheus_client as prom
import pytest
import zmq

from distbelief.operator.status import scrape

from distbelief.runtime import errors
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.contract import JobConfig
from distbelief.runtime.model.job import Job
from distbelief.runtime.observe.metrics import TrafficCollector
from distbelief.runtime.observe.traffic import PROCESS_TRAFFIC
from distbelief.runtime.params import dense
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.params.optim import Adagrad
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.protocol import Header, Status

from support.shards import LiveShards, start_shards
from support.waiting import eventually


def test_pull_returns_the_initial_parameters(two_shards: LiveShards) -> None:
    group = two_shards.group()
    out = np.zeros(two_shards.layout.total, dtype=np.float32)
    replies = Float32Dense(group).pull(out)
    assert [r.header.step for r in replies] == [0, 0]
    np.testing.assert_array_equal(out, np.arange(two_shards.layout.total, dtype=np.float32) / 100)


def test_every_socket_of_the_process_counts_its_traffic_and_the_metrics_report_it(two_shards: LiveShards) -> None:
    registry = prom.CollectorRegistry()
    registry.register(TrafficCollector())
    before = (PROCESS_TRAFFIC.bytes_in, PROCESS_TRAFFIC.bytes_out)
    group = two_shards.group()
    out = np.zeros(two_shards.layout.total, dtype=np.float32)
    Float32Dense(group).pull(out)
    Float32Dense(group).push(np.ones_like(out), steps=[0, 0], examples=1, loss=1.0)
    # The shards and the client live in this process: each byte one of them sent, another got.
    moved = group.bytes_in + group.bytes_out
    assert moved > 2 * out.nbytes  # the parameters came and the gradient went
    # a shard counts its reply just after sending it: the client may read it first
    eventually(lambda: PROCESS_TRAFFIC.bytes_out - before[1] >= moved, 5, interval=0.01, what="the reply counted")
    assert (PROCESS_TRAFFIC.bytes_in - before[0], PROCESS_TRAFFIC.bytes_out - before[1]) == (moved, moved)
    scraped = scrape.parse(prom.generate_latest(registry).decode())
    assert (scraped.bytes_in, scraped.bytes_out) == (PROCESS_TRAFFIC.bytes_in, PROCESS_TRAFFIC.bytes_out)


def test_push_applies_adagrad_on_every_shard(two_shards: LiveShards) -> None:
    layout, group = two_shards.layout, two_shards.group()
    expected = np.arange(layout.total, dtype=np.float32) / 100
    reference = Adagrad(layout.total, 0.5)
    rng = np.random.default_rng(1)
    for _ in range(3):
        grad = rng.standard_normal(layout.total).astype(np.float32)
        replies = Float32Dense(group).push(grad, steps=[0, 0], examples=8, loss=1.0)
        reference.apply(expected, grad)
    assert [r.header.step for r in replies] == [3, 3]
    out = np.empty(layout.total, dtype=np.float32)
    Float32Dense(group).pull(out)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    stats = group.stats()
    assert [s["step"] for s in stats] == [3, 3]


def test_push_and_pull_returns_the_parameters_with_the_push_applied(two_shards: LiveShards) -> None:
    layout, group = two_shards.layout, two_shards.group()
    expected = np.arange(layout.total, dtype=np.float32) / 100
    Adagrad(layout.total, 0.5).apply(expected, np.full(layout.total, 2.0, np.float32))
    out = np.zeros(layout.total, dtype=np.float32)
    replies = Float32Dense(group).push_and_pull(np.full(layout.total, 2.0, np.float32), out, steps=[0, 0], examples=8,
                                                loss=1.0)
    assert [r.header.step for r in replies] == [1, 1]
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    pulled = np.empty_like(out)
    Float32Dense(group).pull(pulled)
    np.testing.assert_array_equal(pulled, out)  # what came back is what the shards hold
    group.done("MaxStepsReached", "Succeeded")
    assert all(r.done for r in Float32Dense(group).push_and_pull(np.ones_like(out), out, steps=[1, 1], examples=8,
                                                                 loss=1.0))
    np.testing.assert_array_equal(out, pulled)  # a finished job takes no more updates


UPDATE = dense.Update(examples=1, loss=1.0).pack()


@pytest.mark.parametrize("op", [dense.PUSH, dense.PUSH_PULL])
def test_a_resent_push_is_answered_but_applied_once(two_shards: LiveShards, op: protocol.OpSpec) -> None:
    """The same (worker, seq) twice is a resend whose reply was lost; another seq is a new push."""
    layout, shard, params = two_shards.layout, two_shards.shards[0], two_shards.params(0)
    grad = np.full(layout.size(0), 0.5, dtype=np.float32)
    expected = params.copy()
    Adagrad(layout.size(0), 0.5).apply(expected, grad)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(two_shards.addresses[0])
    try:
        replies = []
        for seq in (7, 7, 8):
            header = Header(op=op.code, shard=0, layout=layout.hash, seq=seq, worker=42, count=layout.size(0))
            peer.send_multipart([header.pack(), UPDATE, grad.tobytes()])
            assert peer.poll(5000)
            frames = peer.recv_multipart()
            replies.append(protocol.unpack_header(frames[0]))
            if op == dense.PUSH_PULL:  # every reply, the repeat's too, carries the parameters as they are
                np.testing.assert_array_equal(np.frombuffer(frames[1], np.float32), params)
            if seq == 7 and len(replies) == 2:
                np.testing.assert_array_equal(params, expected)  # the resend changed nothing
    finally:
        peer.close()
    assert [(r.status, r.seq, r.step) for r in replies] == [(Status.OK, 7, 1), (Status.OK, 7, 1), (Status.OK, 8, 2)]
    assert shard.step == 2


def test_a_push_pull_repeated_after_the_job_finished_says_done(two_shards: LiveShards) -> None:
    layout, group = two_shards.layout, two_shards.group(worker_id=42)
    out = np.empty(layout.total, dtype=np.float32)
    Float32Dense(group).push_and_pull(np.ones(layout.total, np.float32), out, steps=[0, 0], examples=1, loss=1.0)
    seq = group._seq
    group.done("MaxStepsReached", "Succeeded")
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(two_shards.addresses[0])
    try:
        header = Header(op=dense.PUSH_PULL.code, shard=0, layout=layout.hash, seq=seq, worker=42,
                        count=layout.size(0))
        peer.send_multipart([header.pack(), UPDATE, np.ones(layout.size(0), np.float32).tobytes()])
        assert peer.poll(5000)
        reply = protocol.unpack_header(peer.recv_multipart()[0])
    finally:
        peer.close()
    assert (reply.status, reply.step) == (Status.DONE, 1)


def test_a_request_that_breaks_its_connection_is_resent_once_per_attempt(tmp_path: Path) -> None:
    """A push larger than the shard accepts (ZMQ_MAXMSGSIZE) makes libzmq drop the link after
    every handshake: the replica must not resend it in a tight loop."""
    live = start_shards(tmp_path, Layout.of([("w", (4, 3))], shards=1), np.zeros(12, np.float32))
    bigger = Layout.of([("w", (400, 300))], shards=1)
    group = ShardGroup(live.addresses, bigger, timeouts=Timeouts(request=0.5, unavailable=1.4))
    try:
        with pytest.raises(errors.ShardUnavailable):
            Float32Dense(group).push(np.ones(bigger.total, np.float32), steps=[0], examples=1, loss=1.0)
    finally:
        group.close()
        live.stop()
    assert 2 <= group.retries <= 6, group.retries  # per 0.5 s attempt: a resend, then the timeout's retry


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_a_request_lost_with_its_shard_is_resent_when_the_connection_breaks(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A shard that takes a request and dies: the replica resends on the disconnect, to the
    shard that comes back on the same port, without waiting out the request timeout."""
    layout = Layout.of([("w", (4, 3))], shards=1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dying = zmq.Context.instance().socket(zmq.ROUTER)
    dying.bind(f"tcp://127.0.0.1:{port}")
    group = ShardGroup([f"tcp://127.0.0.1:{port}"], layout, timeouts=Timeouts(request=120.0, unavailable=240.0))
    live = None
    try:
        group._links[0].send([Header(op=protocol.HELLO.code, shard=0, layout=layout.hash).pack()])  # handshake
        assert dying.poll(5000)
        dying.recv_multipart()
        pulled: list = []
        dense = Float32Dense(group)
        puller = threading.Thread(target=lambda: pulled.append(dense.pull(np.empty(layout.total, np.float32))),
                                  daemon=True)
        with caplog.at_level(logging.INFO, logger="distbelief.runtime.transport"):
            puller.start()
            assert dying.poll(5000), "the pull never reached the first shard"
            dying.close(linger=0)  # dies holding the request
            # libzmq closes the listener in its I/O thread, a moment later
            eventually(lambda: _port_is_free(port), 10, what=f"port {port} free")
            live = start_shards(tmp_path, layout, np.ones(layout.total, np.float32),
                                bind=f"tcp://127.0.0.1:{port}")
            puller.join(timeout=60)
        assert not puller.is_alive(), "the pull waited for its request timeout"
        assert pulled and pulled[0][0].header.status == Status.OK
        assert "event=peer_disconnected peer='shard 0 at" in caplog.text and "event=peer_silent" not in caplog.text
        assert group.retries == 1
    finally:
        group.close()
        if live:
            live.stop()


def test_a_peer_with_another_layout_is_refused_by_name(two_shards: LiveShards) -> None:
    other = Layout.of([("w", (10, 7)), ("b", (7,))], shards=3)  # same model, other shard count
    foreign = ShardGroup(two_shards.addresses + ["tcp://127.0.0.1:1"], other,
                         timeouts=Timeouts(request=2.0, unavailable=4.0))
    with pytest.raises(errors.LayoutMismatch, match="layout mismatch"):
        foreign.hello()
    foreign.close()


def test_a_silent_shard_is_reported_with_its_address(two_shards: LiveShards) -> None:
    two_shards.stop()
    group = two_shards.group(timeouts=Timeouts(request=0.2, unavailable=0.6))
    with pytest.raises(errors.ShardUnavailable, match=r"shard \d at tcp://127\.0\.0\.1:\d+"):
        group.hello()


def _hostile_messages(layout: Layout, rng: random.Random) -> list[list[bytes]]:
    """Malformed, mis-sized, mis-addressed, non-finite and foreign messages. (Finite but
    huge gradients are applied, clipped: test_a_huge_gradient_is_clipped_to_the_bound...)"""
    size0 = layout.size(0)
    good = dict(op=dense.PUSH.code, shard=0, layout=layout.hash, count=size0)
    nan = np.full(size0, np.nan, dtype=np.float32).tobytes()
    valid = np.ones(size0, dtype=np.float32).tobytes()

    def header(**fields: int) -> bytes:
        return Header(**{**good, **fields}).pack()

    def raw_header(magic: bytes = protocol.MAGIC, version: int = protocol.VERSION, op: int = dense.PUSH.code,
                   status: int = 0, error: int = 0, count: int = size0) -> bytes:
        return protocol.HEADER.pack(magic, version, op, status, error, 0, 1, 1, layout.hash, 0, count)

    unknown_ops = [op for op in range(256) if op not in protocol.OPS]
    kinds = [
        lambda: [rng.randbytes(rng.randint(0, 200))],
        lambda: [header()[: rng.randint(0, protocol.HEADER.size - 1)], UPDATE, valid],
        lambda: [raw_header(magic=b"XX"), UPDATE, valid],
        lambda: [raw_header(version=9), UPDATE, valid],
        lambda: [raw_header(op=rng.choice(unknown_ops)), UPDATE, valid],
        lambda: [raw_header(status=rng.randint(4, 255)), UPDATE, valid],
        lambda: [raw_header(status=Status.ERROR, error=1), UPDATE, valid],
        lambda: [header(count=size0 + rng.randint(1, 10)), UPDATE, valid],
        lambda: [header(count=2**40), UPDATE, valid],
        lambda: [header(), UPDATE, valid[: rng.randint(0, len(valid) - 1)]],
        lambda: [header(), UPDATE, valid + b"\0\0\0\0"],
        lambda: [header(), UPDATE, nan],
        lambda: [header(), dense.Update(examples=0, loss=1.0).pack(), valid],
        lambda: [header(), struct.pack("<If", 1, float("nan")), valid],
        lambda: [header(), UPDATE[:-1], valid],
        lambda: [header(), valid],
        lambda: [header(layout=layout.hash ^ 1), UPDATE, valid],
        lambda: [header(shard=1), UPDATE, valid],
        lambda: [header(shard=7), UPDATE, valid],
        lambda: [header(), UPDATE, valid, valid],
        lambda: [header()],
        lambda: [header(op=dense.PULL.code, count=0), valid],
        lambda: [header(op=protocol.DONE.code, count=0), b"\xff\xfe not json"],
        lambda: [header(op=protocol.DONE.code, count=0)],
        lambda: [struct.pack("<Q", rng.getrandbits(64)) * 5, UPDATE, valid],
    ]
    return [rng.choice(kinds)() for _ in range(1000)]


def test_hostile_frames_never_update_and_the_shard_keeps_serving(two_shards: LiveShards) -> None:
    layout = two_shards.layout
    shard = two_shards.shards[0]
    before = two_shards.params(0).copy()
    context = zmq.Context.instance()
    attacker = context.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(two_shards.addresses[0])
    messages = _hostile_messages(layout, random.Random(7))
    for frames in messages:
        attacker.send_multipart(frames)
    replies = 0
    while attacker.poll(2000):
        frames = attacker.recv_multipart()
        assert protocol.unpack_header(frames[0]).status == Status.ERROR
        replies += 1
    attacker.close()
    out = np.empty(layout.total, dtype=np.float32)
    pulled = Float32Dense(two_shards.group()).pull(out)
    assert pulled[0].header.step == 0, "a hostile message was applied as an update"
    np.testing.assert_array_equal(two_shards.params(0), before)
    np.testing.assert_array_equal(out[: layout.size(0)], before)
    assert shard.metrics.rejected._value.get() == len(messages)  # every one refused...
    assert 0 < replies < len(messages)  # ...with an error reply, or dropped when unparseable


def test_done_reaches_every_peer_and_survives_a_restart(tmp_path: Path, two_shards: LiveShards) -> None:
    group = two_shards.group()
    Float32Dense(group).push(np.ones(two_shards.layout.total, dtype=np.float32), steps=[0, 0], examples=1, loss=1.0)
    group.done("MaxStepsReached", "Succeeded")
    out = np.empty(two_shards.layout.total, dtype=np.float32)
    assert all(r.done for r in Float32Dense(group).pull(out))
    assert all(r.done for r in group.hello())
    assert group.stats()[0]["finished"]["reason"] == "MaxStepsReached"
    two_shards.stop()
    again = start_shards(tmp_path, two_shards.layout, np.zeros(two_shards.layout.total, np.float32))
    try:
        assert all(s.finished and s.finished["reason"] == "MaxStepsReached" for s in again.shards)
        assert all(r.done for r in again.group().hello())
    finally:
        again.stop()


def test_a_restarted_shard_continues_from_its_checkpoint(tmp_path: Path, two_shards: LiveShards) -> None:
    layout, group = two_shards.layout, two_shards.group()
    for _ in range(5):
        Float32Dense(group).push(np.full(layout.total, 0.1, dtype=np.float32), steps=[0, 0], examples=4, loss=0.5)
    trained = np.concatenate([two_shards.params(i).copy() for i in range(2)])
    two_shards.stop()  # writes the final checkpoint
    again = start_shards(tmp_path, layout, np.zeros(layout.total, np.float32), learning_rate=0.5)
    try:
        assert [s.step for s in again.shards] == [5, 5]
        assert [s.restarts for s in again.shards] == [1, 1]
        out = np.empty(layout.total, dtype=np.float32)
        replies = Float32Dense(again.group()).pull(out)
        assert [r.header.step for r in replies] == [5, 5]
        np.testing.assert_array_equal(out, trained)
    finally:
        again.stop()


def test_warmstart_admits_one_replica_until_its_steps_are_applied(tmp_path: Path) -> None:
    layout = Layout.of([("w", (4, 3))], shards=1)
    live = start_shards(tmp_path, layout, np.zeros(layout.total, np.float32), warmstart_steps=3)
    try:
        first, second = live.group(worker_id=1), live.group(worker_id=2)
        assert first.hello()[0].header.status == Status.OK
        assert second.hello()[0].header.status == Status.WAIT
        for _ in range(3):
            Float32Dense(first).push(np.ones(layout.total, np.float32), steps=[0], examples=1, loss=1.0)
        assert second.hello()[0].header.status == Status.OK
    finally:
        live.stop()


def _softmax_worker(tmp_path: Path, addresses: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a `distbelief worker` for a softmax job on digits."""
    config = {"name": "softmax", "namespace": "default", "spec": {
        "model": {"type": "softmax"}, "data": {"source": "builtin:digits", "testFraction": 0.2, "seed": 0},
        "training": {"batchSize": 8, "fetchEvery": 1, "pushEvery": 1},
        "parameterServers": {"shards": len(addresses), "port": 7070}}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "distbelief.operator.cli", "worker", "--config", str(path),
               "--metrics-port", "0", "--listen", "127.0.0.1"]
    return command, {**os.environ, "DISTBELIEF_PS_ADDRESSES": ",".join(addresses)}


def test_a_worker_role_with_another_model_exits_with_a_clear_error(tmp_path: Path, two_shards: LiveShards) -> None:
    command, env = _softmax_worker(tmp_path, two_shards.addresses)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "layout mismatch" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_worker_waiting_for_absent_shards_stops_promptly_on_sigterm(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command, env = _softmax_worker(tmp_path, [f"tcp://127.0.0.1:{port}"])
    worker = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in worker.stdout:  # wait until it is up and waiting for the shard
            if "metrics_listening" in line:
                break
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=20) == 0
    finally:
        worker.kill()


# A one-shard softmax job's config, as the roles read it.
SOFTMAX_JOB = {"name": "softmax", "namespace": "default", "spec": {
    "model": {"type": "softmax"}, "data": {"source": "builtin:digits", "testFraction": 0.2, "seed": 0},
    "training": {"learningRate": 0.1, "optimizer": "adagrad", "warmstartSteps": 0, "seed": 0, "maxGradientNorm": 100,
                 "maxSteps": 10, "evalEverySeconds": 5, "sandblaster": {"historySize": 4}},
    "parameterServers": {"shards": 1, "port": 7070, "checkpoint": {"everySeconds": 30, "keep": 3}}}}


def run_shard_zero(folder: Path, config: dict) -> subprocess.CompletedProcess[str]:
    """`distbelief ps` for shard 0 of config, on folder/shard-0, to its end."""
    (folder / "job.json").write_text(json.dumps(config))
    return subprocess.run(
        [sys.executable, "-m", "distbelief.operator.cli", "ps", "--config", str(folder / "job.json"),
         "--shard", "0", "--port", "0", "--metrics-port", "0", "--listen", "127.0.0.1",
         "--checkpoint-dir", str(folder / "shard-0"), "--keys-dir", str(folder / "no-keys")],
        capture_output=True, text=True, timeout=60)


def test_a_shard_resumed_with_another_optimizer_stops_in_one_line_and_keeps_its_checkpoints(tmp_path: Path) -> None:
    config = SOFTMAX_JOB
    job = Job(JobConfig.from_json(json.dumps(config)))
    written = start_shards(tmp_path, job.layout, job.model.init_params(0), optimizer="sgd")
    Float32Dense(written.group()).push(np.ones(job.layout.total, np.float32), steps=[0], examples=1, loss=1.0)
    written.stop()  # its final checkpoint records sgd
    saved = sorted(os.listdir(tmp_path / "shard-0"))
    done = run_shard_zero(tmp_path, config)
    assert done.returncode == 2
    errors_said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors_said) == 1 and "'sgd'" in errors_said[0] and "'adagrad'" in errors_said[0]
    assert "Traceback" not in done.stderr
    assert sorted(os.listdir(tmp_path / "shard-0")) == saved


def test_a_shard_of_a_new_job_refuses_the_checkpoints_a_deleted_job_of_its_name_left(tmp_path: Path) -> None:
    """On a cluster the config carries the job's uid, which the shards record in their
    checkpoints: a job re-created under the same name that meets the old job's volume stops
    with a config error (InvalidConfig) naming both, never resumes the old training, and
    keeps the files; the same job (an upgrade, a restart) resumes."""
    config = {**SOFTMAX_JOB, "uid": "new-job-uid"}
    job = Job(JobConfig.from_json(json.dumps(config)))
    assert job.config.uid == "new-job-uid"
    old = start_shards(tmp_path, job.layout, job.model.init_params(0), job_uid="old-job-uid")
    Float32Dense(old.group()).push(np.ones(job.layout.total, np.float32), steps=[0], examples=1, loss=1.0)
    old.stop()  # its final checkpoint records the old job's uid
    saved = sorted(os.listdir(tmp_path / "shard-0"))
    done = run_shard_zero(tmp_path, config)
    assert done.returncode == 2
    (said,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert "another job of this name (uid old-job-uid; this job is new-job-uid)" in said
    assert sorted(os.listdir(tmp_path / "shard-0")) == saved
    same = start_shards(tmp_path, job.layout, job.model.init_params(0), job_uid="old-job-uid")
    try:
        assert same.shards[0].step == 1  # the job itself resumes
    finally:
        same.stop()


@pytest.mark.parametrize("poison", ["huge", "overflowing"])
def test_a_huge_gradient_is_clipped_to_the_bound_and_counted(tmp_path: Path, poison: str) -> None:
    layout = Layout.of([("w", (50,))], shards=1)
    live = start_shards(tmp_path, layout, np.zeros(layout.total, np.float32), optimizer="sgd", learning_rate=0.1)
    live.shards[0].plugin(dense.DenseSlice).max_gradient_norm = 10.0
    grad = np.zeros(layout.total, np.float32)
    grad[:2] = (3e6, 4e6) if poison == "huge" else (1.8e19, 0.0)  # the second overflows a float32 dot
    try:
        Float32Dense(live.group()).push(grad, steps=[0], examples=1, loss=1.0)
        params = live.params(0)
        assert np.isfinite(params).all()
        assert np.linalg.norm(params) == pytest.approx(0.1 * 10.0, rel=1e-5)  # lr x the bound, in grad's direction
        np.testing.assert_allclose(params[:2] / np.linalg.norm(params), -grad[:2] / np.linalg.norm(grad[:2]),
                                   rtol=1e-5)
        assert live.shards[0].metrics.clipped._value.get() == 1
        Float32Dense(live.group()).push(np.full(layout.total, 0.01, np.float32), steps=[1], examples=1, loss=1.0)
        assert live.shards[0].metrics.clipped._value.get() == 1  # an honest push is applied as it is
    finally:
        live.stop()


def test_a_non_finite_state_never_reaches_a_checkpoint_and_is_restored(tmp_path: Path) -> None:
    layout = Layout.of([("w", (8,))], shards=1)
    live = start_shards(tmp_path, layout, np.zeros(layout.total, np.float32), optimizer="sgd", learning_rate=0.1)
    shard, folder = live.shards[0], tmp_path / "shard-0"
    try:
        Float32Dense(live.group()).push(np.ones(layout.total, np.float32), steps=[0], examples=1, loss=1.0)
        shard.checkpoint_now()
        good = live.params(0).copy()
        Float32Dense(live.group()).push(np.ones(layout.total, np.float32), steps=[1], examples=1, loss=1.0)
        live.params(0)[3] = np.inf  # as an overflowing update would leave it
        written = sorted(os.listdir(folder))
        shard.checkpoint_now()
        assert sorted(os.listdir(folder)) == written  # nothing written, nothing pruned
        np.testing.assert_array_equal(live.params(0), good)
        assert shard.step == 1 and shard.metrics.non_finite._value.get() == 1
    finally:
        live.stop()
