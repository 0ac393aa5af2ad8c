"""The stages' keypair of a partitioned job (spec.model.partitions > 1): a stage's serving
socket admits the job's replicas and no one else, through the real ZeroMQ handshake and ZAP
handler, encrypted (CurveZMQ) or not (PLAIN with the replica token)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import zmq

from distbelief.runtime import errors, keys
from distbelief.runtime.transport import interface, zmq_server, zmq_transport

ANSWER_SECONDS = 5.0    # a peer that got in has its answer by then
REFUSED_SECONDS = 0.5   # how long a refused peer is watched for a message getting through


@pytest.fixture
def stage(job_keys: keys.JobKeys, encrypted: bool) -> Iterator[zmq_server.ZmqServer]:
    """A stage's ROUTER in a context of its own: a ZAP handler stopped and started again at
    once in one context can find its inproc endpoint not yet released."""
    context = zmq.Context()
    server = zmq_transport.ZmqTransport(context).server("tcp://127.0.0.1:*", who="stage test", max_frame=1024,
                                                    max_frames=4, security=job_keys.stage_security(encrypted=encrypted))
    yield server
    server.close()
    context.term()


def _send(stage: zmq_server.ZmqServer, options: dict[int, Any] | None, text: bytes) -> zmq.Socket:
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    for option, value in (options or {}).items():
        peer.setsockopt(option, value)
    peer.connect(stage.endpoint)
    peer.send(text)
    return peer


def _serve_one(stage: zmq_server.ZmqServer, seconds: float) -> interface.Incoming | None:
    """The next message, answered with its own bytes; None if none came in time."""
    if not stage.poll(seconds):
        return None
    incoming = stage.receive()
    assert incoming is not None
    stage.send(incoming.peer, [bytes(incoming.frames[0])])
    return incoming


def test_a_stage_answers_a_replica_of_its_job(stage: zmq_server.ZmqServer, job_keys: keys.JobKeys,
                                              encrypted: bool) -> None:
    peer = _send(stage, job_keys.stage_client_options(encrypted=encrypted), b"activations")
    try:
        incoming = _serve_one(stage, ANSWER_SECONDS)
        assert incoming is not None and bytes(incoming.frames[0]) == b"activations"
        assert incoming.user == (job_keys.client_public.decode() if encrypted else keys.REPLICA)
        assert peer.poll(int(ANSWER_SECONDS * 1000)) and peer.recv() == b"activations"
    finally:
        peer.close()


def _outsiders(job_keys: keys.JobKeys, encrypted: bool) -> dict[str, dict[int, Any] | None]:
    """Peers a stage must refuse: another job's replica, the job's own chief, a replica that
    expects the shards' key rather than the stages', and a peer with no security at all."""
    stranger = keys.JobKeys.generate()
    if not encrypted:
        return {"another-jobs-replica": stranger.stage_client_options(encrypted=False),
                "the-chief": job_keys.client_options(role=keys.CHIEF, encrypted=False),
                "no-security": None}
    return {"another-jobs-replica": {**stranger.stage_client_options(), zmq.CURVE_SERVERKEY: job_keys.stage_public},
            "the-chief": {**job_keys.client_options(role=keys.CHIEF), zmq.CURVE_SERVERKEY: job_keys.stage_public},
            "expects-the-shards-key": job_keys.client_options(),
            "no-security": None}


def test_a_stage_refuses_a_foreign_key_the_chief_and_an_unsecured_peer(
        stage: zmq_server.ZmqServer, job_keys: keys.JobKeys, encrypted: bool) -> None:
    for name, options in _outsiders(job_keys, encrypted).items():
        peer = _send(stage, options, b"forged activations")
        try:
            assert _serve_one(stage, REFUSED_SECONDS) is None, f"{name} got through"
            assert not peer.poll(0), f"{name} got an answer"
        finally:
            peer.close()
    replica = _send(stage, job_keys.stage_client_options(encrypted=encrypted), b"still serving")
    try:
        assert _serve_one(stage, ANSWER_SECONDS) is not None  # the refusals did not stop the stage
    finally:
        replica.close()


def _copy(tmp_path: Path, job_keys: keys.JobKeys, names: tuple[str, ...]) -> keys.JobKeys:
    files = job_keys.files()
    (tmp_path / "k").mkdir()
    for name in names:
        (tmp_path / "k" / name).write_text(files[name])
    copy = keys.JobKeys.read(str(tmp_path / "k"))
    assert copy is not None
    return copy


def test_a_partitioned_workers_copy_serves_and_reaches_stages(tmp_path: Path, job_keys: keys.JobKeys) -> None:
    copy = _copy(tmp_path, job_keys, (*keys.CLIENT_FILES, *keys.STAGE_FILES))
    assert copy.stage_security().admitted == {keys.REPLICA: job_keys.client_public}
    assert copy.stage_security().options[zmq.CURVE_SECRETKEY] == job_keys.stage_secret
    assert copy.stage_security(encrypted=False).admitted == {keys.REPLICA: job_keys.plain_token()}
    options = copy.stage_client_options()
    assert (options[zmq.CURVE_SERVERKEY], options[zmq.CURVE_PUBLICKEY]) == (job_keys.stage_public,
                                                                            job_keys.client_public)
    assert copy.stage_client_options(encrypted=False) == job_keys.client_options(encrypted=False)


def test_a_copy_without_the_stage_keys_cannot_serve_a_stage_nor_reach_one(tmp_path: Path,
                                                                           job_keys: keys.JobKeys) -> None:
    copy = _copy(tmp_path, job_keys, keys.CLIENT_FILES)
    with pytest.raises(errors.ConfigError, match="no stage.secret"):
        copy.stage_security()
    with pytest.raises(errors.ConfigError, match="no stage.secret"):
        copy.stage_security(encrypted=False)
    with pytest.raises(errors.ConfigError, match="no stage.public"):
        copy.stage_client_options()


def test_a_mismatched_stage_pair_is_refused(tmp_path: Path, job_keys: keys.JobKeys) -> None:
    job_keys.write(str(tmp_path))
    (tmp_path / keys.STAGE_PUBLIC).write_text(keys.JobKeys.generate().stage_public.decode() + "\n")
    with pytest.raises(errors.ConfigError, match="stage.public does not match its secret key"):
        keys.JobKeys.read(str(tmp_path))


def test_a_keys_folder_of_an_earlier_version_gets_the_stages_keypair(tmp_path: Path) -> None:
    made = keys.JobKeys.generate()
    keys.write_files(str(tmp_path), {name: text for name, text in made.files().items()
                                     if not name.startswith("stage.")})
    upgraded = keys.ensure(str(tmp_path))
    assert (upgraded.client_secret, upgraded.chief_secret) == (made.client_secret, made.chief_secret)
    assert upgraded.stage_secret is not None and upgraded.stage_public not in (made.stage_public, None)
    assert keys.ensure(str(tmp_path)) == upgraded  # added once, then kept
