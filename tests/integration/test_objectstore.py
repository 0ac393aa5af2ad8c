"""Training files in an S3-compatible bucket: moto's S3 server, started here on loopback with
IAM authentication on (tools/fetch-moto installs it in a venv of its own), a user whose
key may read the bucket, a job that trains from it, and a wrong key that fails fast."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow.fs as pafs
import pytest

from distbelief.operator.local import local, report
from distbelief.operator.render import render
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import errors, jobspec
from distbelief.runtime.model import data, files

from support.examples import load_example
from support.filejobs import job, sparse_job, write_ctr_parquet, write_teacher_parquet
from support.paths import REPO

MOTO_BIN = Path(os.environ.get("DISTBELIEF_MOTO", REPO / ".cache" / "moto")) / "bin"
BUCKET = "training-data"
# The IAM calls that make the user and its key, before moto asks every request to be signed.
SETUP = """
import json, sys
import boto3
iam = boto3.client("iam", endpoint_url=sys.argv[1], region_name="us-east-1",
                   aws_access_key_id="setup", aws_secret_access_key="setup")
iam.create_user(UserName="trainer")
iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
key = iam.create_access_key(UserName="trainer")["AccessKey"]
print(key["AccessKeyId"], key["SecretAccessKey"])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[dict[str, str]]:
    if not (MOTO_BIN / "moto_server").exists():
        subprocess.run([str(REPO / "tools" / "fetch-moto")], check=True, stdout=subprocess.DEVNULL)
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}   # the 3 IAM calls of SETUP
    server = subprocess.Popen([str(MOTO_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_for(port)
        keys = subprocess.run([str(MOTO_BIN / "python"), "-c", SETUP, endpoint], check=True, capture_output=True,
                              text=True).stdout.split()
        yield {"endpoint": endpoint, "host": f"127.0.0.1:{port}", "key": keys[0], "secret": keys[1]}
    finally:
        server.terminate()
        server.wait(timeout=30)


def _wait_for(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("moto's server did not start")


def upload(store: dict[str, str], folder: Path, prefix: str) -> None:
    fs = pafs.S3FileSystem(access_key=store["key"], secret_key=store["secret"], endpoint_override=store["host"],
                           scheme="http", region="us-east-1", allow_bucket_creation=True)
    fs.create_dir(BUCKET)
    for path in sorted(folder.iterdir()):
        with fs.open_output_stream(f"{BUCKET}/{prefix}/{path.name}") as out:
            out.write(path.read_bytes())


@pytest.fixture
def credentials(store, monkeypatch) -> dict[str, str]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", store["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", store["secret"])
    return store


def test_a_bucket_reads_as_the_same_files_on_a_volume(tmp_path, credentials):
    write_teacher_parquet(tmp_path / "local", files=4, per_file=200, group=50)
    upload(credentials, tmp_path / "local", "same")
    store = jobspec.ObjectStore(endpoint=credentials["endpoint"])
    remote = data.load(jobspec.Data(source=f"s3://{BUCKET}/same/*.parquet", object_store=store))
    on_disk = data.load(jobspec.Data(source=f"parquet:{tmp_path}/local/*.parquet"))
    np.testing.assert_array_equal(remote.x_train, on_disk.x_train)
    np.testing.assert_array_equal(remote.y_test, on_disk.y_test)
    file_set = files.FileSet(jobspec.Data(source=f"s3://{BUCKET}/same/*.parquet", object_store=store))
    assert len(file_set.train_units) == 12 and file_set.train_units[0].file.startswith(f"s3://{BUCKET}/same/")


def test_a_wrong_key_fails_fast_naming_the_bucket_and_the_problem(tmp_path, credentials, monkeypatch):
    write_teacher_parquet(tmp_path / "local", files=2, per_file=50, group=50)
    upload(credentials, tmp_path / "local", "denied")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(errors.ConfigError, match=rf"cannot list bucket '{BUCKET}'.*SIGNATURE_DOES_NOT_MATCH"):
        files.FileSet(jobspec.Data(source=f"s3://{BUCKET}/denied/*.parquet",
                                   object_store=jobspec.ObjectStore(endpoint=credentials["endpoint"])))


@pytest.mark.slow
def test_a_local_job_trains_from_the_bucket(tmp_path, credentials):
    write_teacher_parquet(tmp_path / "local", files=5, per_file=300, group=100)
    upload(credentials, tmp_path / "local", "train")
    doc = job(f"s3://{BUCKET}/train/*.parquet", objectStore={"endpoint": credentials["endpoint"]})
    code = local.LocalRun(DistBeliefJob.validated(doc), str(tmp_path / "out")).run(progress=False)
    summary = json.loads((tmp_path / "out" / report.REPORT_FILE).read_text())
    assert code == 0 and summary["reason"] == "TargetAccuracyReached" and summary["accuracy"] >= 0.95
    # Streamed: at least half the bucket's units (of 3 per file) went through before the target
    # stopped the run; the target comes before a whole epoch in some runs (0.83 in one).
    assert summary["epoch"] >= 0.5


def test_credentials_reach_the_pods_from_the_secret_never_the_config_map():
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["data"] = {"source": f"s3://{BUCKET}/train/*.parquet",
                           "objectStore": {"endpoint": "http://minio.storage:9000", "secretRef": "minio-keys"}}
    objects = render.render_children(DistBeliefJob.validated(doc), image="distbelief:test")
    pods = [o for o in objects if o["kind"] in ("StatefulSet", "Deployment")]
    assert len(pods) == 2
    for pod in pods:
        env = {e["name"]: e for e in pod["spec"]["template"]["spec"]["containers"][0]["env"]}
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key]["valueFrom"] == {"secretKeyRef": {"name": "minio-keys", "key": key}}
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    assert "AWS_" not in json.dumps(config) and "minio-keys" in json.dumps(config)  # the name only


@pytest.mark.slow
def test_a_job_with_a_wrong_key_fails_as_invalid_config_naming_the_bucket(tmp_path, credentials, monkeypatch):
    write_teacher_parquet(tmp_path / "local", files=2, per_file=50, group=50)
    upload(credentials, tmp_path / "local", "refused")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")   # the pods inherit local mode's environment
    doc = job(f"s3://{BUCKET}/refused/*.parquet", objectStore={"endpoint": credentials["endpoint"]})
    code = local.LocalRun(DistBeliefJob.validated(doc), str(tmp_path / "out")).run(progress=False)
    summary = json.loads((tmp_path / "out" / report.REPORT_FILE).read_text())
    assert code == 1 and summary["phase"] == "Failed" and summary["restarts"] == 0
    assert summary["reason"].startswith("InvalidConfig") and f"bucket '{BUCKET}'" in summary["reason"]


@pytest.mark.slow
def test_a_local_job_with_embeddings_streams_its_units_from_the_bucket(tmp_path, credentials):
    write_ctr_parquet(tmp_path / "local", files=8, per_file=1000, group=500)
    upload(credentials, tmp_path / "local", "clicks")
    doc = sparse_job(f"s3://{BUCKET}/clicks/*.parquet", objectStore={"endpoint": credentials["endpoint"]})
    doc["spec"]["training"]["maxSteps"] = 300
    code = local.LocalRun(DistBeliefJob.validated(doc), str(tmp_path / "out")).run(progress=False)
    summary = json.loads((tmp_path / "out" / report.REPORT_FILE).read_text())
    assert code == 0 and summary["phase"] == "Succeeded", summary["reason"]
    assert summary["auc"] >= 0.7 and summary["epoch"] >= 1
    read = [line for path in (tmp_path / "out" / "logs").glob("files-worker-*.log")
            for line in path.read_text().splitlines() if "event=unit_read" in line]
    assert read and all(f"where='s3://{BUCKET}/clicks/" in line for line in read)   # each unit from the bucket
