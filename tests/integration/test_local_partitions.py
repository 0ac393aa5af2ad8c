"""Local mode plans a partitioned job's pods as the cluster would run them: one process per
pod of each partition's Deployment, each told its partition, where its stage serves on
loopback, and where the rendezvous beside shard 0 listens. (Nothing is started here.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distbelief.operator.local import local, preflight
from distbelief.operator.validation import spec
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.operator.status import scrape
from distbelief.runtime import contract, keys
from distbelief.runtime.model.job import Job
from distbelief.runtime.wire.layout import Layout

from support.examples import load_example


@pytest.fixture
def run(tmp_path: Path) -> local.LocalRun:
    return local.LocalRun(DistBeliefJob.validated(load_example("digits-partitioned.yaml")), str(tmp_path))


def test_each_partition_s_pods_are_named_after_their_deployment(run: local.LocalRun) -> None:
    assert [pod.name for pod in run.shards] == ["digits-partitioned-ps-0", "digits-partitioned-ps-1"]
    assert [pod.name for pod in run.workers] == [f"digits-partitioned-worker-p{k}-{i}" for k in (0, 1)
                                                 for i in range(3)]
    assert {pod.workload for pod in run.workers} == {"digits-partitioned-worker-p0", "digits-partitioned-worker-p1"}


def test_each_worker_knows_its_partition_its_stage_and_the_rendezvous(run: local.LocalRun) -> None:
    chief = run.shards[0]
    coordinator_port = chief.ports[contract.COORDINATOR_PORT_NAME]
    assert chief.argv[chief.argv.index("--coordinator-port") + 1] == str(coordinator_port)
    stages = set()
    for pod in run.workers:
        partition = pod.name.split("-p")[-1].split("-")[0]
        assert pod.env[contract.ENV_PARTITION] == partition
        assert pod.env[contract.ENV_POD_IP] == "127.0.0.1"
        assert pod.env[contract.ENV_STAGE_ADDRESS] == f"tcp://127.0.0.1:{pod.ports[contract.STAGE_PORT_NAME]}"
        assert pod.env[contract.ENV_COORDINATOR_ADDRESS] == f"tcp://127.0.0.1:{coordinator_port}"
        assert len(pod.env[contract.ENV_PS_ADDRESSES].split(",")) == 2
        stages.add(pod.env[contract.ENV_STAGE_ADDRESS])
    assert len(stages) == len(run.workers)  # a port of its own for every pod


def test_each_worker_gets_the_stage_keys_and_no_server_secret(run: local.LocalRun) -> None:
    for pod in run.workers:
        folder = pod.argv[pod.argv.index("--keys-dir") + 1]
        assert sorted(p.name for p in Path(folder).iterdir()) == sorted((*keys.CLIENT_FILES, *keys.STAGE_FILES))
        copy = keys.JobKeys.read(folder)
        assert copy is not None and copy.server_secret is None
        assert copy.stage_security().admitted == {keys.REPLICA: copy.client_public}


def test_an_unpartitioned_job_s_workers_get_no_stage(tmp_path: Path) -> None:
    plain = local.LocalRun(DistBeliefJob.validated(load_example("digits-mlp.yaml")), str(tmp_path))
    for pod in plain.workers:
        assert not {contract.ENV_PARTITION, contract.ENV_STAGE_ADDRESS, contract.ENV_COORDINATOR_ADDRESS} & set(pod.env)
        assert contract.STAGE_PORT_NAME not in pod.ports


def test_the_status_counts_replicas_whose_every_partition_runs(run: local.LocalRun) -> None:
    """Three pods of partition 0 and one of partition 1 running make one complete replica."""
    running = [pod for pod in run.workers if pod.name.startswith("digits-partitioned-worker-p0-")] + \
        [run.workers[3]]
    try:
        for pod in running:
            pod.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        observed = run._observe(scrape.Figures())
        assert (observed.workers, observed.workers_ready) == (3, 1)
    finally:
        for pod in running:
            pod.process.kill()
            pod.process.wait()


def test_local_mode_checks_earlier_checkpoints_against_the_staged_layout() -> None:
    """The layout a partitioned job's shards write (stages on shards of their own) is the
    one `distbelief run` expects in an output folder, so a run resumes; a layout that
    ignored the cut would refuse the job's own checkpoints."""
    job = spec.validate_job(load_example("digits-partitioned.yaml"))
    checked = preflight.check(DistBeliefJob.of(job))
    assert checked.layout.hash == Job(spec.job_config(job)).layout.hash
    assert checked.layout.hash != Layout.of(checked.shapes, 2).hash
