"""The job's keys (distbelief.runtime.keys): files, and live shards that admit only peers
holding them, through the real ZeroMQ handshake and ZAP handler, encrypted (CurveZMQ) or not
(PLAIN with a token derived from the keys)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
from pathlib import Path
from typing import Iterator

import numpy as np
import prometheus_client as prom
import pytest
import zmq

from distbelief.operator.local import local
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract, errors, jobresolve, keys
from distbelief.runtime.client.group import Timeouts
from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.roles import common
from distbelief.runtime.shard.core import Shard, ShardSettings
from distbelief.runtime.transport import admission
from distbelief.runtime.wire.layout import Layout

from support.cli import run_cli
from support.examples import load_example
from support.shards import LiveShards, start_shards

REFUSED = Timeouts(request=0.3, unavailable=1.0)


def test_keys_round_trip_through_a_folder_of_0600_files(tmp_path: Path) -> None:
    made = keys.JobKeys.generate()
    made.write(str(tmp_path / "keys"))
    assert stat.S_IMODE(os.stat(tmp_path / "keys").st_mode) == 0o700
    for name in keys.FILES:
        path = tmp_path / "keys" / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert len(path.read_text().strip()) == keys.Z85_KEY_LENGTH
    assert keys.JobKeys.read(str(tmp_path / "keys")) == made
    security = made.server_security()
    assert security.mechanism == "curve" and security.options[zmq.CURVE_SERVER] == 1
    assert security.admitted == {keys.REPLICA: made.client_public, keys.CHIEF: made.chief_public}
    assert security.is_chief(made.chief_public.decode()) and not security.is_chief(made.client_public.decode())
    assert made.client_options()[zmq.CURVE_SERVERKEY] == made.server_public
    assert made.client_options(role=keys.CHIEF)[zmq.CURVE_PUBLICKEY] == made.chief_public
    with pytest.raises(errors.ConfigError):
        made.write(str(tmp_path / "keys"))  # never overwrites a key


def test_ensure_makes_keys_once_and_then_reuses_them(tmp_path: Path) -> None:
    first = keys.ensure(str(tmp_path / "k"))
    assert keys.ensure(str(tmp_path / "k")) == first
    assert keys.JobKeys.read(str(tmp_path / "none")) is None
    (tmp_path / "empty").mkdir()
    assert keys.JobKeys.read(str(tmp_path / "empty")) is None


def test_a_replica_copy_without_the_server_secret_cannot_serve(tmp_path: Path) -> None:
    files = keys.JobKeys.generate().files()
    (tmp_path / "k").mkdir()
    for name in keys.CLIENT_FILES:
        (tmp_path / "k" / name).write_text(files[name])
    copy = keys.JobKeys.read(str(tmp_path / "k"))
    assert copy is not None and copy.server_secret is None
    assert copy.client_options()[zmq.CURVE_SECRETKEY] == files[keys.CLIENT_SECRET].strip().encode()
    with pytest.raises(errors.ConfigError, match="server.secret"):
        copy.server_security()


@pytest.mark.parametrize("damage, message", [
    (lambda folder: (folder / keys.CLIENT_PUBLIC).unlink(), "lacks client.public"),
    (lambda folder: (folder / keys.SERVER_PUBLIC).write_text("short\n"), "not a 40-character Z85 key"),
    (lambda folder: (folder / keys.CLIENT_PUBLIC).write_text(
        keys.JobKeys.generate().client_public.decode() + "\n"), "client.public does not match"),
])
def test_incomplete_or_mismatched_keys_are_one_clear_error(tmp_path: Path, damage, message: str) -> None:
    keys.JobKeys.generate().write(str(tmp_path))
    damage(tmp_path)
    with pytest.raises(errors.ConfigError, match=message) as caught:
        keys.JobKeys.read(str(tmp_path))
    assert str(tmp_path) in str(caught.value) and "\n" not in str(caught.value)


def test_each_role_s_plain_token_comes_from_its_secret_without_revealing_it() -> None:
    made, other = keys.JobKeys.generate(), keys.JobKeys.generate()
    token, chief = made.plain_token(), made.plain_token(keys.CHIEF)
    assert token == keys.JobKeys(**{**made.__dict__, "server_secret": None, "chief_secret": None}).plain_token()
    assert len({token, chief, other.plain_token()}) == 3 and made.client_secret not in token and len(token) == 64
    assert made.client_options(encrypted=False) == {zmq.PLAIN_USERNAME: b"replica", zmq.PLAIN_PASSWORD: token}
    assert made.client_options(role=keys.CHIEF, encrypted=False)[zmq.PLAIN_USERNAME] == b"chief"
    security = made.server_security(encrypted=False)
    assert security.mechanism == "plain" and security.options == {zmq.PLAIN_SERVER: 1}
    assert security.admitted == {keys.REPLICA: token, keys.CHIEF: chief}
    assert security.is_chief("chief") and not security.is_chief("replica") and not security.is_chief(None)


def test_a_replica_copy_cannot_act_as_the_chief(tmp_path: Path) -> None:
    files = keys.JobKeys.generate().files()
    (tmp_path / "k").mkdir()
    for name in (*keys.CLIENT_FILES, keys.CHIEF_PUBLIC):
        (tmp_path / "k" / name).write_text(files[name])
    copy = keys.JobKeys.read(str(tmp_path / "k"))
    with pytest.raises(errors.ConfigError, match="no chief secret key"):
        copy.client_options(role=keys.CHIEF)


@pytest.fixture
def secured_shards(tmp_path: Path, job_keys: keys.JobKeys, encrypted: bool) -> Iterator[LiveShards]:
    layout = Layout.of([("w", (10, 7)), ("b", (7,))], shards=2)
    initial = np.arange(layout.total, dtype=np.float32) / 100
    live = start_shards(tmp_path, layout, initial, learning_rate=0.5, checkpoint_every=3600,
                        security=job_keys.server_security(encrypted=encrypted), bulk_bind="tcp://127.0.0.1:*")
    yield live
    live.stop()


def _outsiders(job_keys: keys.JobKeys) -> dict[str, dict | None]:
    """Peers that lack the job's keys: a CurveZMQ one that knows the server's public key,
    one that forged a client public key without its secret, a PLAIN one with another job's
    token, one with the right user name and a guessed token, and one with no security."""
    stranger = keys.JobKeys.generate()
    knows_server = {**stranger.client_options(), zmq.CURVE_SERVERKEY: job_keys.server_public}
    forged = {**knows_server, zmq.CURVE_PUBLICKEY: job_keys.client_public}
    guessed = {**stranger.client_options(encrypted=False), zmq.PLAIN_PASSWORD: b"0" * 64}
    return {"knows-the-server-key": knows_server, "forged-client-public-key": forged,
            "another-jobs-token": stranger.client_options(encrypted=False), "guessed-token": guessed,
            "no-security": None}


def test_a_peer_without_the_job_keys_can_neither_pull_nor_push(secured_shards: LiveShards,
                                                               job_keys: keys.JobKeys) -> None:
    layout = secured_shards.layout
    before = [secured_shards.params(i).copy() for i in range(2)]
    for name, options in _outsiders(job_keys).items():
        outsider = secured_shards.group(security=options, timeouts=REFUSED)
        try:
            with pytest.raises(errors.ShardUnavailable):
                Float32Dense(outsider).pull(np.empty(layout.total, dtype=np.float32))
            with pytest.raises(errors.ShardUnavailable):
                Float32Dense(outsider).push(np.ones(layout.total, dtype=np.float32), steps=[0, 0], examples=1, loss=1.0)
            assert outsider.bytes_in == 0, f"{name} got bytes back"
        finally:
            outsider.close()
    assert [s.step for s in secured_shards.shards] == [0, 0]
    for index, (shard, params) in enumerate(zip(secured_shards.shards, before)):
        np.testing.assert_array_equal(secured_shards.params(index), params)
        assert shard.metrics.rejected._value.get() == 0  # refused in the handshake, before any message


def test_a_peer_with_the_job_keys_pulls_and_pushes(secured_shards: LiveShards, job_keys: keys.JobKeys,
                                                   encrypted: bool, caplog: pytest.LogCaptureFixture) -> None:
    layout = secured_shards.layout
    group = secured_shards.group(security=job_keys.client_options(encrypted=encrypted))
    try:
        out = np.zeros(layout.total, dtype=np.float32)
        with caplog.at_level(logging.DEBUG):  # what --log-level debug would show
            assert [r.header.step for r in Float32Dense(group).pull(out)] == [0, 0]
        assert job_keys.plain_token().decode() not in caplog.text  # pyzmq logs PLAIN passwords at debug
        np.testing.assert_array_equal(out, np.arange(layout.total, dtype=np.float32) / 100)
        replies = Float32Dense(group).push(np.ones(layout.total, dtype=np.float32), steps=[0, 0], examples=1, loss=1.0)
        assert [r.header.step for r in replies] == [1, 1]
    finally:
        group.close()


def test_a_slice_of_exactly_the_largest_accepted_size_gets_through_the_cipher(
        tmp_path: Path, job_keys: keys.JobKeys, encrypted: bool) -> None:
    """The shard's frame limit is its slice; CurveZMQ wraps each frame in a box, which the
    limit must leave room for (a slice over 64 KiB, where the limit is the slice itself);
    so must the bulk channel's tag (the second push goes there, once the session is granted)."""
    layout = Layout.of([("w", (300, 100))], shards=1)
    live = start_shards(tmp_path, layout, np.zeros(layout.total, np.float32),
                        security=job_keys.server_security(encrypted=encrypted), bulk_bind="tcp://127.0.0.1:*")
    group = live.group(security=job_keys.client_options(encrypted=encrypted))
    try:
        out = np.empty(layout.total, np.float32)
        for step in (0, 1):
            replies = Float32Dense(group).push_and_pull(np.ones(layout.total, np.float32), out, steps=[step], examples=1,
                                                        loss=1.0)
            assert [r.step for r in replies] == [step + 1] and np.all(out < 0)
        assert (group._links[0].session is not None) is encrypted
    finally:
        group.close()
        live.stop()


def test_stopped_shards_release_their_zap_handler(tmp_path: Path, job_keys: keys.JobKeys) -> None:
    layout = Layout.of([("w", (3,))], shards=1)
    live = start_shards(tmp_path, layout, np.zeros(3, np.float32), security=job_keys.server_security())
    assert id(zmq.Context.instance()) in admission._auth_by_context
    live.stop()
    assert id(zmq.Context.instance()) not in admission._auth_by_context


def test_a_secured_server_without_client_credentials_is_refused(tmp_path: Path, job_keys: keys.JobKeys,
                                                                 encrypted: bool) -> None:
    layout = Layout.of([("w", (3,))], shards=1)
    security = dataclasses.replace(job_keys.server_security(encrypted=encrypted), admitted={})
    settings = ShardSettings(shard=0, bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path), security=security)
    shard = Shard(settings, layout, ShardMetrics(prom.CollectorRegistry(), 0))
    with pytest.raises(errors.ConfigError, match="admit any peer"):
        shard.serve()
    assert not shard.ready.is_set()


class _Job:
    """What load_access reads of a job: its typed spec (a config from before
    spec.parameterServers.encryption resolves as the CRD's default, True) and its plan."""

    def __init__(self, **parameter_servers: object) -> None:
        self.spec = jobresolve.resolve({"data": {"source": "builtin:digits"}, "parameterServers": parameter_servers})
        self.plan = None  # not partitioned


def test_roles_without_keys_run_unauthenticated_and_say_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert common.load_access(str(tmp_path / "absent"), contract.ROLE_PS, _Job()) == common.Access()
    assert "event=unauthenticated role=ps" in caplog.text
    assert str(tmp_path / "absent") in caplog.text


def test_roles_take_the_jobs_choice_of_encryption_and_warn_when_it_is_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    made = keys.JobKeys.generate()
    made.write(str(tmp_path / "k"))
    with caplog.at_level(logging.WARNING):
        shard = common.load_access(str(tmp_path / "k"), contract.ROLE_PS, _Job())  # a config from before the field
        worker = common.load_access(str(tmp_path / "k"), contract.ROLE_WORKER, _Job(encryption=True))
    assert "event=unencrypted" not in caplog.text
    assert shard == common.Access(server=made.server_security(), client=made.client_options(role=keys.CHIEF))
    assert worker == common.Access(server=None, client=made.client_options())
    with caplog.at_level(logging.WARNING):
        plain = common.load_access(str(tmp_path / "k"), contract.ROLE_PS, _Job(encryption=False))
    assert plain == common.Access(server=made.server_security(encrypted=False),
                                 client=made.client_options(role=keys.CHIEF, encrypted=False))
    assert "event=unencrypted role=ps" in caplog.text


def test_local_mode_gives_every_pod_the_job_keys_and_keeps_them_on_resume(tmp_path: Path) -> None:
    job = spec.validate_job(load_example("digits-mlp.yaml"))
    run = local.LocalRun(DistBeliefJob.of(job), str(tmp_path))
    made = keys.JobKeys.read(str(tmp_path / local.KEYS_FOLDER))
    assert made is not None and made.server_secret is not None
    for pod in run.pods:
        folder = pod.argv[pod.argv.index("--keys-dir") + 1]
        assert folder == local.volume_dir(str(tmp_path), pod.name, contract.KEYS_VOLUME)
        names = sorted(os.listdir(folder))
        expected = keys.FILES if pod.role == contract.ROLE_PS else keys.CLIENT_FILES
        assert names == sorted(expected)
        assert all(stat.S_IMODE(os.stat(os.path.join(folder, n)).st_mode) == 0o600 for n in names)
        copy = keys.JobKeys.read(folder)
        assert copy is not None and copy.client_secret == made.client_secret
    local.LocalRun(DistBeliefJob.of(job), str(tmp_path))  # a resumed run: the same keys, not new ones
    assert keys.JobKeys.read(str(tmp_path / local.KEYS_FOLDER)) == made


def test_a_role_with_damaged_keys_stops_with_one_clear_line(tmp_path: Path) -> None:
    config = {"name": "softmax", "namespace": "default", "spec": {
        "model": {"type": "softmax"}, "data": {"source": "builtin:digits", "testFraction": 0.2, "seed": 0},
        "training": {"batchSize": 8, "fetchEvery": 1, "pushEvery": 1},
        "parameterServers": {"shards": 1, "port": 7070}}}
    (tmp_path / "job.json").write_text(json.dumps(config))
    keys.JobKeys.generate().write(str(tmp_path / "k"))
    (tmp_path / "k" / keys.SERVER_PUBLIC).unlink()
    done = run_cli("worker", "--config", str(tmp_path / "job.json"), "--keys-dir", str(tmp_path / "k"),
                   "--metrics-port", "0", "--listen", "127.0.0.1", timeout=60,
                   env={contract.ENV_PS_ADDRESSES: "tcp://127.0.0.1:1"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"error: keys folder {tmp_path / 'k'} lacks server.public"
    assert "Traceback" not in done.stderr


def test_a_serving_socket_can_be_bound_again_right_after_the_last_one_of_its_context_closed(
        job_keys: keys.JobKeys) -> None:
    """The context's ZAP handler stops with its last server; libzmq frees its endpoint a
    moment later, and a server bound at once must still start (a shard restarting in a
    process, or the next test)."""
    context = zmq.Context()
    try:
        for _ in range(30):
            socket = context.socket(zmq.ROUTER)
            admitted = admission.bind_server(context, socket, "tcp://127.0.0.1:*", who="restart test",
                                             domain="restart-test", security=job_keys.server_security())
            socket.close(linger=0)
            admitted.close()
    finally:
        context.term()
