"""`kubectl distbelief` (installed as `kubectl-distbelief`, which kubectl runs as a plugin):
what a DistBeliefJob is doing, its pods' logs and figures, and scale, suspend and resume.

    kubectl distbelief get [JOB] [-n NS | -A]       phase, progress, step, accuracy, ETA
    kubectl distbelief describe JOB                 one screen: why its phase, progress, shards, pods, Events
    kubectl distbelief logs JOB [--role ps|worker|chief] [--shard N] [-f]
    kubectl distbelief scale JOB N                  spec.workers.replicas
    kubectl distbelief suspend JOB | resume JOB     spec.runPolicy.suspend
    kubectl distbelief top JOB [--interval S]       each pod's steps/s, CPU, memory, traffic

`--local DIR` reads a local run's output folder instead of a cluster (get, describe, logs,
top while it runs). Errors end in one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import urllib3

from distbelief.operator import errors
from distbelief.operator.plugin import pods as pods_of
from distbelief.operator.plugin import top, views
from distbelief.operator.status import scrape
from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract

SCRAPE_THREADS = 16


class Jobs(Protocol):
    """Where the jobs are: a cluster (clusterjobs.ClusterJobs) or a local run's folder
    (localjobs.LocalJobs). Either raises errors.OperatorError for what it cannot do."""

    def jobs(self, *, all_namespaces: bool = False) -> list[DistBeliefJob]: ...
    def job(self, name: str) -> DistBeliefJob: ...
    def pods(self, job: DistBeliefJob) -> list[pods_of.Pod]: ...
    def events(self, job: DistBeliefJob) -> list[views.Event] | None: ...
    def metrics(self, pod: pods_of.Pod) -> str: ...
    def logs(self, pods: list[pods_of.Pod], *, follow: bool) -> None: ...
    def scale(self, name: str, replicas: int) -> None: ...
    def suspend(self, name: str, suspended: bool) -> None: ...


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(open_jobs(args), args) or 0
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (| head): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (errors.OperatorError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except urllib3.exceptions.HTTPError as exc:  # the client's, when no answer came at all
        print(f"error: the API server did not answer: {getattr(exc, 'reason', None) or exc}", file=sys.stderr)
        return 1


def open_jobs(args: argparse.Namespace) -> Jobs:
    """Where the jobs are: the local folder, or the cluster of the kubeconfig's context."""
    if args.local:
        from distbelief.operator.plugin.localjobs import LocalJobs

        return LocalJobs(args.local)
    from distbelief.operator.plugin.clusterjobs import ClusterJobs, connect

    kube, namespace = connect(args.kubeconfig, args.context)
    return ClusterJobs(kube, args.namespace or namespace)


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _get(jobs: Jobs, args: argparse.Namespace) -> int:
    found = [jobs.job(args.job)] if args.job else jobs.jobs(all_namespaces=args.all_namespaces)
    if not found:
        print(f"no {contract.KIND} found", file=sys.stderr)
        return 0
    print(views.get_table(found, now(), namespaces=args.all_namespaces))
    return 0


def _describe(jobs: Jobs, args: argparse.Namespace) -> int:
    job = jobs.job(args.job)
    print(views.describe(job, jobs.pods(job), jobs.events(job), now()))
    return 0


def _logs(jobs: Jobs, args: argparse.Namespace) -> int:
    job = jobs.job(args.job)
    chosen = pods_of.select(job.config, jobs.pods(job), role=args.role, shard=args.shard)
    if not chosen:
        raise errors.OperatorError(f"job {args.job} has no pods{_which(args)} now")
    jobs.logs(chosen, follow=args.follow)
    return 0


def _which(args: argparse.Namespace) -> str:
    return "".join(f" of {name} {value}" for name, value in (("role", args.role), ("shard", args.shard))
                   if value is not None)


def _scale(jobs: Jobs, args: argparse.Namespace) -> int:
    jobs.scale(args.job, args.replicas)
    print(f"{contract.KIND} {args.job} scaled to {args.replicas} replicas")
    return 0


def _suspend(jobs: Jobs, args: argparse.Namespace) -> int:
    suspended = args.command == "suspend"
    jobs.suspend(args.job, suspended)
    print(f"{contract.KIND} {args.job} {'suspended: its pods stop, its checkpoints stay' if suspended else 'resumed'}")
    return 0


def _top(jobs: Jobs, args: argparse.Namespace) -> int:
    job = jobs.job(args.job)
    running = [pod for pod in jobs.pods(job) if pod.phase == "Running"]
    if not running:
        raise errors.OperatorError(f"job {args.job} has no running pods")
    samples = sample(jobs, running, args.interval)
    print(top.top_table(samples))
    for failed in samples:
        if failed.error:
            print(f"error: {failed.pod.name}: {failed.error}", file=sys.stderr)
    return 1 if all(s.error for s in samples) else 0


def sample(jobs: Jobs, pods: list[pods_of.Pod], seconds: float) -> list[top.Sample]:
    """Each pod's metrics read twice, `seconds` apart (all pods at once each time)."""
    def read_all() -> list[tuple[scrape.Figures, str | None]]:
        with concurrent.futures.ThreadPoolExecutor(min(SCRAPE_THREADS, len(pods))) as pool:
            return list(pool.map(lambda pod: read(jobs, pod), pods))

    first, started = read_all(), time.monotonic()
    time.sleep(seconds)
    second = read_all()
    taken = time.monotonic() - started
    return [top.Sample(pod, a, b, taken, error=b_error or a_error)
            for pod, (a, a_error), (b, b_error) in zip(pods, first, second)]


def read(jobs: Jobs, pod: pods_of.Pod) -> tuple[scrape.Figures, str | None]:
    """A pod's figures, or empty ones and why it did not answer (a pod that just ended, say)."""
    try:
        return scrape.parse(jobs.metrics(pod)), None
    except (errors.OperatorError, OSError, ValueError) as exc:
        return scrape.Figures(), str(exc)


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: must be more than 0")
    return value


def replicas(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: the replicas are a whole number, 0 or more")
    return int(text)


def where_options(default: Any) -> argparse.ArgumentParser:
    """The options that say where the jobs are; taken before the command (default None) and
    after it (default SUPPRESS: there they override only when given)."""
    options = argparse.ArgumentParser(add_help=False)
    where = options.add_argument_group("where the jobs are")
    where.add_argument("-n", "--namespace", default=default, help="default: the kubeconfig context's namespace")
    where.add_argument("--kubeconfig", default=default, help="default: $KUBECONFIG, else ~/.kube/config")
    where.add_argument("--context", default=default, help="default: the kubeconfig's current context")
    where.add_argument("--local", default=default, metavar="DIR",
                       help="a local run's output folder (distbelief run --output DIR) instead of a cluster")
    return options


def parser() -> argparse.ArgumentParser:
    common = where_options(argparse.SUPPRESS)
    top_parser = argparse.ArgumentParser(
        prog="kubectl distbelief", parents=[where_options(None)],
        description="What DistBeliefJobs are doing, their pods' logs and figures; scale, suspend and resume. "
                    "From the kubeconfig's cluster, or from a local run's output folder (--local DIR).")
    commands = top_parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func: Any, text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, parents=[common], help=text, description=text)
        sub.set_defaults(func=func)
        return sub

    get = command("get", _get, "phase, progress, step, held-out accuracy and ETA of jobs")
    get.add_argument("job", nargs="?", metavar="JOB")
    get.add_argument("-A", "--all-namespaces", action="store_true")
    command("describe", _describe, "what a job is doing: phase and why, progress, shards, pods, Events") \
        .add_argument("job", metavar="JOB")
    logs = command("logs", _logs, "the logs of a job's pods")
    logs.add_argument("job", metavar="JOB")
    logs.add_argument("--role", choices=pods_of.ROLES, default=None,
                      help="only the shards' (ps), the replicas' (worker), or the chief's (shard 0's first copy)")
    logs.add_argument("--shard", type=int, default=None, metavar="N", help="only parameter shard N's pods (its copies)")
    logs.add_argument("-f", "--follow", action="store_true", help="go on printing what the pods log")
    scale = command("scale", _scale, "set a job's model replicas (spec.workers.replicas)")
    scale.add_argument("job", metavar="JOB")
    scale.add_argument("replicas", type=replicas, metavar="N")
    command("suspend", _suspend, "stop a job's pods, keeping its checkpoints").add_argument("job", metavar="JOB")
    command("resume", _suspend, "start a suspended job again from its checkpoints").add_argument("job", metavar="JOB")
    top_command = command("top", _top, "each pod's steps/s, CPU, memory and traffic, from its metrics")
    top_command.add_argument("job", metavar="JOB")
    top_command.add_argument("--interval", type=positive, default=2.0, metavar="S",
                             help="seconds between the two reads the rates come from (default 2)")
    return top_parser


if __name__ == "__main__":
    sys.exit(main())
