"""`distbelief ps`: one copy of one parameter shard, and beside the first copy of shard 0
the chief (and the algorithm's helper: Sandblaster's coordinator, a partitioned job's
rendezvous).

It reads the resolved job config (the ConfigMap's file), builds the model and the layout
from it exactly as every other role does, attaches the algorithm's plugins to the shard
core, restores the newest checkpoint, serves metrics, and serves until the job is done.
Exit codes: 0 when the job is done or the role was asked to stop, 1 when a shard stayed
unreachable, 2 for a config or layout the role cannot work with.
"""

from __future__ import annotations

import os

from distbelief.runtime import contract, errors
from distbelief.runtime.algorithms import interface, registry
from distbelief.runtime.algorithms.chief import Chief, Scorer, StoppingRules, WholeModel
from distbelief.runtime.algorithms.quality import HeldOutRecord, chance_level
from distbelief.runtime.algorithms.pipeline.evaluation import StagedModel
from distbelief.runtime.observe.metrics import ChiefMetrics, MetricsServer, ShardMetrics
from distbelief.runtime.model.job import Job
from distbelief.runtime.roles.common import load_access, new_registry, shard_group, stop_on_termination
from distbelief.runtime.shard.copies import replication, stores
from distbelief.runtime.shard.journal import Journal
from distbelief.runtime.shard.core import Shard, ShardSettings


def run_ps(*, config_path: str, shard: int | None, port: int | None, metrics_port: int, listen: str,
           checkpoint_dir: str, linger: float, keys_dir: str = contract.KEYS_DIR,
           coordinator_port: int = contract.COORDINATOR_PORT, bulk_port: int = contract.BULK_PORT) -> int:
    stop = stop_on_termination()
    job = Job.load(config_path)
    access = load_access(keys_dir, contract.ROLE_PS, job)
    algorithm = registry.of(job)
    ordinal = shard if shard is not None else contract.shard_index_from_pod_name(os.environ.get(contract.ENV_POD_NAME, ""))
    index, rank = job.config.copy_of(ordinal)
    servers = job.spec.parameter_servers
    settings = ShardSettings(
        shard=index, bind=f"tcp://{listen}:{port or servers.port}", checkpoint_dir=checkpoint_dir,
        checkpoint_every=servers.checkpoint.every_seconds, checkpoint_keep=servers.checkpoint.keep,
        linger_seconds=linger, security=access.server,
        bulk_bind=f"tcp://{listen}:{bulk_port}", job_uid=job.config.uid)
    metrics_registry = new_registry()
    server = Shard(settings, job.layout, ShardMetrics(metrics_registry, index), stop=stop)
    algorithm.attach(server, job)
    if servers.copies > 1:
        server.serve_copies(replication.Copies(server, rank=rank, addresses=copy_routes(job.config, index),
                                               security=access.client, store=stores.open_store(job.config.names, index),
                                               lease_seconds=lease_seconds(), min_in_sync=servers.min_in_sync))
    journal = attach_journal(server) if servers.journal else None
    server.restore()
    if journal is not None:
        journal.replay()
    metrics = MetricsServer(metrics_registry, metrics_port, ready=server.ready.is_set, host=listen).start()
    helpers: list[tuple[str, interface.Helper]] = []
    if ordinal == 0:  # the chief runs beside the first copy of shard 0
        context = interface.ChiefContext(
            job=job, shard=server, registry=metrics_registry, server_security=access.server,
            group=lambda shards=None, stop=None: shard_group(job, security=access.client, shards=shards, stop=stop),
            coordinator_bind=f"tcp://{listen}:{coordinator_port}", output_dir=checkpoint_dir)
        chief = _start_chief(context, checkpoint_dir, algorithm)
        helpers.append(("chief", chief))
        beside = algorithm.beside_chief(context)
        if beside is not None:
            helpers.append((algorithm.name, beside))
            chief.more_figures = getattr(beside, "figures", chief.more_figures)  # the dispenser's epoch
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


def attach_journal(server: Shard) -> Journal:
    """The shard's journal, in its checkpoints and in its replication slot (a job without backups)."""
    journal = Journal(server)
    server.attach(journal)
    server.serve_copies(journal)
    return journal


def copy_routes(config: contract.JobConfig, shard: int) -> list[str]:
    """How this copy reaches each copy of its shard, by rank: their shard addresses, or
    DISTBELIEF_COPY_ROUTES (a fault-injecting proxy between copies, a network of their own)."""
    routes = [a.strip() for a in os.environ.get(contract.ENV_COPY_ROUTES, "").split(",") if a.strip()]
    if not routes:
        return config.copy_addresses()[shard]
    copies = config.spec.parameter_servers.copies
    if len(routes) != copies:
        raise errors.ConfigError(f"{contract.ENV_COPY_ROUTES} lists {len(routes)} addresses for the "
                                 f"{copies} copies of shard {shard}")
    return routes


def lease_seconds() -> float:
    """The copies' lease: DISTBELIEF_COPY_LEASE_SECONDS, else replication.LEASE_SECONDS. A
    longer one asks the view store less often (each copy calls it six times per lease) and
    fails over later."""
    text = os.environ.get(contract.ENV_COPY_LEASE, "").strip()
    try:
        seconds = float(text) if text else replication.LEASE_SECONDS
    except ValueError:
        seconds = -1.0
    if not 0.5 <= seconds <= 300:
        raise errors.ConfigError(f"{contract.ENV_COPY_LEASE}={text!r}: seconds from 0.5 to 300")
    return seconds


def _start_chief(ctx: interface.ChiefContext, output_dir: str, algorithm: interface.Algorithm) -> Chief:
    job, server, group = ctx.job, ctx.shard, ctx.group()
    training, max_eval = job.spec.training, job.spec.data.max_eval_examples
    if job.plan is None:
        scorer: Scorer = WholeModel(group, job.model, job.dataset, max_eval, held_out=algorithm.held_out(job, group))
    else:
        scorer = StagedModel(job.plan, [ctx.group(job.stage_shards(k), group.stop) for k in range(len(job.plan.stages))],
                             job.dataset, max_eval)
    two_classes = job.dataset.n_classes == 2
    record = HeldOutRecord(two_classes=two_classes, chance=chance_level(job.dataset.y_test[:max_eval], two_classes))
    record.replay(os.path.join(output_dir, contract.HISTORY_FILE))
    chief = Chief(group=group, scorer=scorer, rules=StoppingRules.of(training),
                  eval_every=training.eval_every_seconds, output_dir=output_dir,
                  start_time=server.start_time, metrics=ChiefMetrics(ctx.registry), training=server.training_figures,
                  optimizer_state=algorithm.optimizer_state(server), copies=job.spec.parameter_servers.copies > 1, record=record,
                  keep_best=training.keep_best, fail_on_degraded=training.fail_on_degraded,
                  fail_on_updates_lost=training.fail_on_updates_lost, rows=job.spec.model.embeddings is not None)
    server.step_reached = chief.step_reached
    chief.on_failure = server.stop
    chief.start()
    return chief
