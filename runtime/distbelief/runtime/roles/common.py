"""What each role's process sets up from the job (model.job.Job: data, model, the cut into
stages, the layout, derived there for every role alike): its keys as the role's sockets
use them, a client of its shards, a metrics registry, and the stop event set by SIGTERM.

The roles themselves are ps.py (`distbelief ps`) and worker.py (`distbelief worker`).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import threading
from typing import Any

import prometheus_client as prom

from distbelief.runtime import contract, errors, keys
from distbelief.runtime.algorithms import interface
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.model.job import Job
from distbelief.runtime.observe.metrics import TrafficCollector

log = logging.getLogger(__name__)

FAILOVER_ATTEMPT_SECONDS = 2.0  # with backups: how long a replica waits for a copy before trying the next


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
    encrypted = job.spec.parameter_servers.encryption
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


def stage_access(job: Job, access: Access, listen: str,
                 environ: dict[str, str] | os._Environ = os.environ) -> interface.StageAccess:
    """A partition pod's stage, from its environment (DISTBELIEF_PARTITION and the stage
    address, which the renderer sets); an unpartitioned job's worker has none."""
    if job.plan is None:
        return interface.StageAccess()
    text = environ.get(contract.ENV_PARTITION, "")
    if not text.isdigit() or int(text) >= len(job.plan.stages):
        raise errors.ConfigError(f"{contract.ENV_PARTITION}={text!r}: a partition pod of this job needs "
                                 f"0..{len(job.plan.stages) - 1}")
    partition, address = int(text), environ.get(contract.ENV_STAGE_ADDRESS, "").strip()
    _, _, port = address.rpartition(":")
    if partition > 0 and not port.isdigit():
        raise errors.ConfigError(f"{contract.ENV_STAGE_ADDRESS}={address!r}: partition {partition} needs "
                                 "the tcp://host:port its group reaches it at")
    return interface.StageAccess(partition=partition, bind=f"tcp://{listen}:{port}" if port.isdigit() else None,
                                  address=address or None, server=access.stage_server, client=access.stage_client)


def new_registry() -> prom.CollectorRegistry:
    """A role's metrics registry; it reports the process's traffic and its own figures
    (process_resident_memory_bytes, CPU seconds, open files) from the start: the dashboard's
    shard memory, and what `kubectl distbelief top` shows."""
    registry = prom.CollectorRegistry()
    registry.register(TrafficCollector())
    prom.ProcessCollector(registry=registry)
    return registry


def shard_group(job: Job, **options: Any) -> ShardGroup:
    """A client of every shard of the job; of every copy, when the shards have backups (with a
    shorter attempt, so that a silent primary sends the request on to a backup within seconds)."""
    if job.spec.parameter_servers.copies == 1:
        return ShardGroup(job.config.shard_addresses(), job.layout, **options)
    return ShardGroup(job.config.copy_addresses(), job.layout, timeouts=Timeouts(request=FAILOVER_ATTEMPT_SECONDS),
                      **options)


def stop_on_termination() -> threading.Event:
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
