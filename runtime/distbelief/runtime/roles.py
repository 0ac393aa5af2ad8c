"""Entry points of the roles the containers run: `distbelief ps` and `distbelief worker`.

Each reads the resolved job config (the ConfigMap's file), builds the model and the
layout from it exactly as every other role does, serves metrics, and runs until the
job is done. Exit codes: 0 when the job is done or the role was asked to stop, 1 when
a shard stayed unreachable, 2 for a config or layout the role cannot work with.
"""

from __future__ import annotations

import dataclasses
import logging
import faulthandler
import os
import signal
import threading
from typing import Any

import prometheus_client as prom

from distbelief.runtime import algorithms, contract, data, embedding, errors, keys, models, replication
from distbelief.runtime.chief import Chief, Scorer, StoppingRules, WholeModel
from distbelief.runtime.client import ShardGroup, Timeouts
from distbelief.runtime.layout import Layout
from distbelief.runtime.metrics import ChiefMetrics, MetricsServer, ShardMetrics, TrafficCollector, WorkerMetrics
from distbelief.runtime.pipeline import stages
from distbelief.runtime.pipeline.evaluation import StagedModel
from distbelief.runtime.shard import Shard, ShardSettings

log = logging.getLogger(__name__)

FAILOVER_ATTEMPT_SECONDS = 2.0  # with backups: how long a replica waits for a copy before trying the next


def model_layout(model: models.Model, config: contract.JobConfig) -> tuple[stages.Plan | None, Layout]:
    """The model's cut into stages (when partitioned) and its layout over the shards, as
    every role (and local mode, checking an output folder's checkpoints) derives them."""
    plan = stages.plan(model, config.partitions) if config.partitions > 1 else None
    return plan, Layout.of(model.shapes, config.shards, plan.boundaries if plan else ())


class Job:
    """What every role derives from the config in the same way: data, model, the cut into
    stages (a partitioned model), layout."""

    def __init__(self, config: contract.JobConfig) -> None:
        self.config = config
        self.spec = config.spec
        self.dataset = data.load(self.spec["data"])
        self.model: models.Model = (
            embedding.build(self.spec["model"], self.dataset) if self.spec["model"].get("embeddings")
            else models.build_model(self.spec["model"], self.dataset.n_features, self.dataset.n_classes))
        self.plan, self.layout = model_layout(self.model, config)

    def stage_shards(self, partition: int) -> list[int]:
        """The shards holding a partition's stage."""
        stage = self.plan.stages[partition]
        return self.layout.shards_of(stage.offset, stage.offset + stage.size)

    @classmethod
    def load(cls, path: str) -> "Job":
        try:
            return cls(contract.JobConfig.load(path))
        except (OSError, ValueError, KeyError) as exc:
            raise errors.ConfigError(f"cannot read job config {path}: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class Access:
    """The job's keys as one role's sockets use them; without keys, all None (anyone gets in)."""

    server: keys.ServerSecurity | None = None  # a shard's or the coordinator's serving socket
    client: dict | None = None                 # a DEALER to a shard or to the coordinator
    stage_server: keys.ServerSecurity | None = None  # a partition pod's stage (partitioned jobs)
    stage_client: dict | None = None                 # a DEALER to another partition pod's stage


def load_access(keys_dir: str, role: str, job: Job) -> Access:
    """The job's keys in keys_dir, for role, with the job's choice of encryption."""
    job_keys = keys.JobKeys.read(keys_dir)
    if job_keys is None:
        log.warning("event=unauthenticated role=%s keys_dir=%s reason=no_keys_there "
                    "consequence=any_peer_that_reaches_the_shards_can_pull_and_push", role, keys_dir)
        return Access()
    encrypted = bool(job.spec["parameterServers"].get("encryption", True))
    if not encrypted:
        log.warning("event=unencrypted role=%s reason=spec.parameterServers.encryption_is_false "
                    "consequence=parameters_gradients_and_the_join_token_cross_the_network_in_the_clear", role)
    if role == contract.ROLE_PS:  # serves; its clients are the chief and the coordinator
        return Access(server=job_keys.server_security(encrypted=encrypted),
                      client=job_keys.client_options(role=keys.CHIEF, encrypted=encrypted))
    if job.plan is None:
        return Access(client=job_keys.client_options(role=keys.REPLICA, encrypted=encrypted))
    return Access(client=job_keys.client_options(role=keys.REPLICA, encrypted=encrypted),
                  stage_server=job_keys.stage_security(encrypted=encrypted),
                  stage_client=job_keys.stage_client_options(encrypted=encrypted))


def run_ps(*, config_path: str, shard: int | None, port: int | None, metrics_port: int, listen: str,
           checkpoint_dir: str, linger: float, keys_dir: str = contract.KEYS_DIR,
           coordinator_port: int = contract.COORDINATOR_PORT, bulk_port: int = contract.BULK_PORT) -> int:
    stop = _stop_on_termination()
    job = Job.load(config_path)
    access = load_access(keys_dir, contract.ROLE_PS, job)
    algorithm = algorithms.of(job)
    ordinal = shard if shard is not None else contract.shard_index_from_pod_name(os.environ.get(contract.ENV_POD_NAME, ""))
    index, rank = job.config.copy_of(ordinal)
    training, checkpointing = job.spec["training"], job.spec["parameterServers"]["checkpoint"]
    settings = ShardSettings(
        shard=index, bind=f"tcp://{listen}:{port or job.config.shard_port}", checkpoint_dir=checkpoint_dir,
        checkpoint_every=float(checkpointing["everySeconds"]), checkpoint_keep=int(checkpointing["keep"]),
        warmstart_steps=int(training["warmstartSteps"]), linger_seconds=linger, security=access.server,
        bulk_bind=f"tcp://{listen}:{bulk_port}", job_uid=job.config.uid)
    registry = _registry()
    server = Shard(settings, job.layout, ShardMetrics(registry, index), stop=stop)
    algorithm.attach(server, job)
    if job.config.copies > 1:
        replication.Copies(server, rank=rank, addresses=job.config.copy_addresses()[index], security=access.client)
    server.restore()
    metrics = MetricsServer(registry, metrics_port, ready=server.ready.is_set, host=listen).start()
    helpers: list[tuple[str, algorithms.Helper]] = []
    if ordinal == 0:  # the chief runs beside the first copy of shard 0
        context = algorithms.ChiefContext(
            job=job, shard=server, registry=registry, server_security=access.server,
            group=lambda shards=None, stop=None: shard_group(job, security=access.client, shards=shards, stop=stop),
            coordinator_bind=f"tcp://{listen}:{coordinator_port}")
        helpers.append(("chief", _start_chief(context, checkpoint_dir, algorithm)))
        beside = algorithm.beside_chief(context)
        if beside is not None:
            helpers.append((algorithm.name, beside))
    try:
        server.serve()
    finally:
        for _, helper in reversed(helpers):
            helper.stop()
        metrics.stop()
    for name, helper in helpers:
        if helper.failure:
            raise errors.RuntimeFailure(f"the {name} stopped: {helper.failure}")
    return 0


def _start_chief(ctx: algorithms.ChiefContext, output_dir: str, algorithm: algorithms.Algorithm) -> Chief:
    job, server, group = ctx.job, ctx.shard, ctx.group()
    training = job.spec["training"]
    max_eval = int(job.spec["data"]["maxEvalExamples"])
    if job.plan is None:
        scorer: Scorer = WholeModel(group, job.model, job.dataset, max_eval, held_out=algorithm.held_out(job, group))
    else:
        scorer = StagedModel(job.plan, [ctx.group(job.stage_shards(k), group.stop) for k in range(len(job.plan.stages))],
                             job.dataset, max_eval)
    chief = Chief(group=group, scorer=scorer, rules=StoppingRules.from_spec(training),
                  eval_every=float(training["evalEverySeconds"]), output_dir=output_dir,
                  start_time=server.start_time, metrics=ChiefMetrics(ctx.registry), training=server.training_figures,
                  optimiser_state=algorithm.optimiser_state(server), copies=job.config.copies > 1)
    server.step_reached = chief.step_reached
    chief.on_failure = server.stop
    chief.start()
    return chief


def run_worker(*, config_path: str, metrics_port: int, listen: str, keys_dir: str = contract.KEYS_DIR) -> int:
    stop = _stop_on_termination()
    job = Job.load(config_path)
    access = load_access(keys_dir, contract.ROLE_WORKER, job)
    registry = _registry()
    stage = stage_access(job, access, listen)
    shards = job.stage_shards(stage.partition) if stage.partition > 0 else None
    group = shard_group(job, stop=stop, security=access.client, shards=shards)
    worker = algorithms.of(job).replica(algorithms.ReplicaContext(
        job=job, group=group, metrics=WorkerMetrics(registry), client_security=access.client, stop=stop,
        stage=stage))
    metrics = MetricsServer(registry, metrics_port, ready=worker.joined.is_set, host=listen).start()
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


def stage_access(job: Job, access: Access, listen: str,
                 environ: dict[str, str] | os._Environ = os.environ) -> algorithms.StageAccess:
    """A partition pod's stage, from its environment (DISTBELIEF_PARTITION and the stage
    address, which the renderer sets); an unpartitioned job's worker has none."""
    if job.plan is None:
        return algorithms.StageAccess()
    text = environ.get(contract.ENV_PARTITION, "")
    if not text.isdigit() or int(text) >= len(job.plan.stages):
        raise errors.ConfigError(f"{contract.ENV_PARTITION}={text!r}: a partition pod of this job needs "
                                 f"0..{len(job.plan.stages) - 1}")
    partition, address = int(text), environ.get(contract.ENV_STAGE_ADDRESS, "").strip()
    _, _, port = address.rpartition(":")
    if partition > 0 and not port.isdigit():
        raise errors.ConfigError(f"{contract.ENV_STAGE_ADDRESS}={address!r}: partition {partition} needs "
                                 "the tcp://host:port its group reaches it at")
    return algorithms.StageAccess(partition=partition, bind=f"tcp://{listen}:{port}" if port.isdigit() else None,
                                  address=address or None, server=access.stage_server, client=access.stage_client)


def _registry() -> prom.CollectorRegistry:
    """A role's metrics registry; it reports the process's traffic from the start."""
    registry = prom.CollectorRegistry()
    registry.register(TrafficCollector())
    return registry


def shard_group(job: Job, **options: Any) -> ShardGroup:
    """A client of every shard of the job; of every copy, when the shards have backups (with a
    shorter attempt, so that a silent primary sends the request on to a backup within seconds)."""
    if job.config.copies == 1:
        return ShardGroup(job.config.shard_addresses(), job.layout, **options)
    return ShardGroup(job.config.copy_addresses(), job.layout, timeouts=Timeouts(request=FAILOVER_ATTEMPT_SECONDS),
                      **options)


def _stop_on_termination() -> threading.Event:
    """An event set by SIGTERM or SIGINT, installed before anything slow starts. SIGUSR2
    writes every thread's stack to stderr (the pod's log): what a role that does not stop is doing.

    The handler only writes a byte to a pipe; a thread of its own sets the event. Python
    runs handlers in the main thread between bytecodes, so a handler that set the event
    itself could interrupt the main thread inside Event.set, holding the event's lock, and
    wait for that lock forever. A parent's death delivers SIGTERM once for each of the
    parent's threads, in quick succession, which made this happen."""
    stop = threading.Event()
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # a flood of signals fills the pipe: the first byte is enough

    def relay() -> None:
        os.read(read_end, 1)
        stop.set()

    def note(*_: Any) -> None:
        try:
            os.write(write_end, b".")
        except BlockingIOError:
            pass
    threading.Thread(target=relay, name="stop-signal", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, note)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    return stop
