"""`python -m localnode --kubeconfig FILE [--name NAME] ...`: run the node agent
until SIGTERM or Ctrl-C (what tools/local-node starts)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import Sequence

from kubernetes.config import ConfigException

from localnode import agent, registration

DESCRIPTION = "Run the pods the scheduler binds to a Node as processes of this machine (tests, a one-machine stack)."


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    options = agent.Options(
        kubeconfig=args.kubeconfig, name=args.name,
        root=os.path.abspath(args.root or os.path.join(state, "distbelief-local-node", args.name)),
        capacity=registration.machine_capacity(args.cpu, args.memory, args.pods), heartbeat=args.heartbeat,
        port=args.port, backoff_start=args.backoff[0], backoff_max=args.backoff[1])
    try:
        node = agent.Agent(options)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, node.stop)
        node.run()
    except (*agent.API_ERRORS, ConfigException) as exc:  # no kubeconfig, no API server: one line, no traceback
        print(f"local-node: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="local-node", description=DESCRIPTION)
    parser.add_argument("--kubeconfig", required=True, metavar="FILE", help="the cluster's kubeconfig")
    parser.add_argument("--name", default=socket.gethostname().split(".")[0].lower(),
                        help="the Node's name (default: this machine's host name)")
    parser.add_argument("--root", default=None, metavar="DIR",
                        help="pods' folders, logs and volumes (default: $XDG_STATE_HOME/distbelief-local-node/NAME)")
    parser.add_argument("--port", type=int, default=0,
                        help="the HTTP endpoint's port on 127.0.0.1: pods by name, logs (default: any free port; "
                             "the Node's status.daemonEndpoints says which)")
    parser.add_argument("--cpu", default=None, help="CPUs the Node offers (default: this machine's)")
    parser.add_argument("--memory", default=None, help="memory the Node offers, a quantity (default: this machine's)")
    parser.add_argument("--pods", type=int, default=None, help=f"pods the Node takes (default {registration.DEFAULT_PODS})")
    parser.add_argument("--heartbeat", type=float, default=5.0, metavar="SECONDS",
                        help="how often the Lease and the Ready condition are renewed")
    parser.add_argument("--backoff", type=float, nargs=2, default=(1.0, 30.0), metavar=("FIRST", "MAX"),
                        help="restart back-off of crashed containers, seconds: the first, doubling up to the most")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


if __name__ == "__main__":
    sys.exit(main())
