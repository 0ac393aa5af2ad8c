"""DistBelief's roles on the pod network, as local mode runs them on loopback.

A shard or replica (`distbelief ps` / `distbelief worker`) finds its shards, the chief's
coordinator and a partitioned job's rendezvous by the headless Service's DNS names,
which only a cluster's DNS answers. Here the role is told the pod IPs those names stand
for, through the overrides the runtime takes from local mode
(DISTBELIEF_PS_ADDRESSES, DISTBELIEF_COORDINATOR_ADDRESS), and serves on its own pod IP
(`--listen`) rather than on every address of the machine, where the next pod's ports
would clash with its own. Every other container runs as it is.
"""

from __future__ import annotations

from typing import Sequence

from localnode.addresses import PodNetwork
from distbelief.runtime import contract

ROLES = ("ps", "worker")


def is_role(command: Sequence[str]) -> bool:
    """Whether the container's entry point and first arg run a DistBelief role."""
    return len(command) >= 2 and command[0] == "distbelief" and command[1] in ROLES


def adapt(argv: list[str], *, pod_ip: str, network: PodNetwork) -> tuple[list[str], dict[str, str]]:
    """The role's command line and the environment it adds: bound to the pod's IP, with its
    peers' names mapped to their pod IPs (read from the job config the role is given)."""
    config = contract.JobConfig.load(_option(argv, "--config") or contract.CONFIG_PATH)
    names = config.names
    servers = config.spec.parameter_servers
    pods = servers.shards * servers.copies
    shards = [network.map_url(names.shard_address(i, config.namespace, servers.port)) for i in range(pods)]
    env = {contract.ENV_PS_ADDRESSES: ",".join(shards),
           contract.ENV_COORDINATOR_ADDRESS: network.map_url(config.coordinator_address({}))}
    return [*argv, "--listen", pod_ip], env


def _option(argv: Sequence[str], flag: str) -> str | None:
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None
