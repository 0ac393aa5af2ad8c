"""`distbelief worker`: one model replica, or one pod of a partitioned replica.

It reads the resolved job config (the ConfigMap's file), builds the model and the layout
from it exactly as every other role does, runs the algorithm's replica loop against the
job's shards, serves metrics, and stops when a shard says the job is done. Exit codes: 0
when the job is done or the role was asked to stop, 1 when a shard stayed unreachable, 2
for a config or layout the role cannot work with.
"""

from __future__ import annotations

import logging

from distbelief.runtime import contract, errors
from distbelief.runtime.algorithms import interface, registry
from distbelief.runtime.observe.metrics import MetricsServer, WorkerMetrics
from distbelief.runtime.model.job import Job
from distbelief.runtime.roles.common import load_access, new_registry, shard_group, stage_access, stop_on_termination

log = logging.getLogger(__name__)


def run_worker(*, config_path: str, metrics_port: int, listen: str, keys_dir: str = contract.KEYS_DIR) -> int:
    stop = stop_on_termination()
    job = Job.load(config_path)
    access = load_access(keys_dir, contract.ROLE_WORKER, job)
    metrics_registry = new_registry()
    stage = stage_access(job, access, listen)
    shards = job.stage_shards(stage.partition) if stage.partition > 0 else None
    group = shard_group(job, stop=stop, security=access.client, shards=shards)
    worker = registry.of(job).replica(interface.ReplicaContext(
        job=job, group=group, metrics=WorkerMetrics(metrics_registry), client_security=access.client, stop=stop,
        stage=stage))
    metrics = MetricsServer(metrics_registry, metrics_port, ready=worker.joined.is_set, host=listen).start()
    try:
        ended = worker.run()
    except errors.Stopped:
        ended = "stopped"
    finally:
        group.close()
        metrics.stop()
    acknowledged = ",".join(str(n) for n in getattr(worker, "acknowledged", []))  # by shard
    log.info("event=worker_exit worker=%08x steps=%d pushes_acknowledged=%s reason=%s", group.worker_id,
             worker.steps, acknowledged or "-", ended)
    return 0
