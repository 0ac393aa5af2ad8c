"""The `distbelief` command: validate, render and run jobs; run the roles and the operator.

Each subcommand imports only what it needs, so the runtime roles (ps, worker) start
without kopf or the kubernetes client. Errors a user can cause end in one line on
stderr naming the problem, and a non-zero exit code; never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from typing import Sequence

from distbelief.runtime import contract

log = logging.getLogger("distbelief")

EXIT_INVALID = contract.EXIT_INVALID_CONFIG
LOG_LEVELS = ["debug", "info", "warning", "error"]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the one place low-level errors become a user's one-liner
        return _report(exc)


def _report(exc: Exception) -> int:
    """One line per problem on stderr, and the exit code, for an error of either tree
    (distbelief.operator.errors, distbelief.runtime.errors) or the OS; anything else is a
    bug, and keeps its traceback."""
    from distbelief.operator import errors as operator_errors
    from distbelief.runtime import errors

    if isinstance(exc, operator_errors.SpecError):
        for line in exc.errors:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_INVALID
    if isinstance(exc, (errors.ConfigError, errors.LayoutMismatch, errors.CheckpointError)):
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if isinstance(exc, errors.Diverged):
        print(f"error: {exc}", file=sys.stderr)
        return contract.EXIT_NON_FINITE_LOSS
    if isinstance(exc, (errors.RuntimeFailure, operator_errors.OperatorError, OSError)):
        print(f"error: {exc}", file=sys.stderr)
        return 1
    raise exc


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distbelief", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    # Global options are taken after the subcommand too; there they override the default only when given.
    anywhere = argparse.ArgumentParser(add_help=False)
    anywhere.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    add_parser = functools.partial(commands.add_parser, parents=[anywhere])

    validate = add_parser("validate", help="check DistBeliefJob manifests against the CRD and its rules")
    validate.add_argument("files", nargs="+", metavar="JOB.yaml")
    validate.set_defaults(func=_validate)

    render = add_parser("render", help="print the Kubernetes objects the operator would create")
    render.add_argument("file", metavar="JOB.yaml")
    render.add_argument("--image", default=None, help="runtime image when the job names none")
    render.add_argument("--operator-namespace", default=None,
                        help="the operator's namespace, which the NetworkPolicy admits (default: the job's)")
    render.set_defaults(func=_render)

    run = add_parser("run", help="run a DistBeliefJob on this machine, without a cluster")
    run.add_argument("file", metavar="JOB.yaml")
    run.add_argument("--output", default=None, metavar="DIR", help="report folder (default: ./out/NAME)")
    run.add_argument("--no-progress", action="store_true", help="no live progress bar")
    run.add_argument("--fresh", action="store_true", help="discard the checkpoints of an earlier run in DIR")
    run.set_defaults(func=_run)

    reshard = add_parser("reshard", help="re-lay a local run's checkpoints for another shard count")
    reshard.add_argument("output", metavar="DIR", help="the run's output folder (distbelief run --output)")
    reshard.add_argument("--shards", type=int, required=True, metavar="N", help="the new shard count")
    reshard.set_defaults(func=_reshard)

    claims = add_parser("reshard-claims", help="re-lay a cluster job's checkpoint claims for another shard count "
                                               "(what the operator's reshard Job runs)")
    claims.add_argument("claims", nargs="+", metavar="CLAIM", help="the mounted checkpoint claims, in shard pod order")
    claims.add_argument("--config", required=True, metavar="FILE", help="the job's config (its ConfigMap's job.json)")
    claims.add_argument("--shards", type=int, required=True, metavar="N", help="the new shard count")
    claims.add_argument("--message-file", default=None, metavar="FILE",
                        help="also write the outcome there (a pod's termination message)")
    claims.set_defaults(func=_reshard_claims)

    predict = add_parser("predict", help="score or use the model a finished run trained")
    predict.add_argument("file", metavar="JOB.yaml")
    predict.add_argument("--output", default=None, metavar="DIR", help="the run's folder (default: ./out/NAME)")
    predict.add_argument("--data", default=None, metavar="SOURCE",
                         help="predict for this source (npz:/path.npz with x, and y if known) instead of scoring "
                              "the held-out split")
    predict.add_argument("--out", default=None, metavar="FILE", help="write the predicted labels (.npz, or text)")
    predict.add_argument("--best", action="store_true",
                         help="use the parameters of the best held-out evaluation (params-best.npz, which "
                              "spec.training.keepBest saves) instead of the final ones")
    predict.set_defaults(func=_predict)

    ps = add_parser("ps", help="run one parameter shard (what the shard containers run)")
    ps.add_argument("--config", default=contract.CONFIG_PATH)
    ps.add_argument("--shard", type=int, default=None,
                    help=f"the pod's ordinal: shard N %% shards, copy N // shards (with backups); "
                         f"default: the ordinal in ${contract.ENV_POD_NAME}")
    ps.add_argument("--port", type=int, default=None, help="default: spec.parameterServers.port")
    ps.add_argument("--metrics-port", type=int, default=contract.METRICS_PORT)
    ps.add_argument("--coordinator-port", type=int, default=contract.COORDINATOR_PORT,
                    help="where shard 0 serves Sandblaster's coordinator, or a partitioned job's rendezvous")
    ps.add_argument("--bulk-port", type=int, default=contract.BULK_PORT,
                    help="encrypted jobs: where the AES-GCM sessions' messages come in")
    ps.add_argument("--listen", default="0.0.0.0", metavar="HOST", help="address to serve on")
    ps.add_argument("--checkpoint-dir", default=contract.CHECKPOINT_DIR)
    ps.add_argument("--keys-dir", default=contract.KEYS_DIR, metavar="DIR",
                    help="the job's CurveZMQ keys; without keys there, no authentication (warned)")
    ps.add_argument("--linger", type=float, default=60.0,
                    help="seconds to keep telling replicas the job is done before exiting")
    ps.set_defaults(func=_ps)

    operator = add_parser("operator", help="run the Kubernetes operator (kopf)")
    operator.add_argument("--namespace", action="append", default=[], metavar="NS",
                          help="watch this namespace (repeatable); all namespaces when absent")
    operator.add_argument("--standalone", action="store_true",
                          help="no peering: for a single operator replica without the kopf.dev CRDs")
    operator.add_argument("--peering", default="distbelief", help="kopf peering name shared by the replicas")
    operator.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", metavar="URL",
                          help="liveness endpoint ('' to disable)")
    operator.add_argument("--metrics", type=metrics_address, default=None, metavar="[HOST:]PORT",
                          help="serve the operator's own Prometheus metrics there (HOST default 0.0.0.0); "
                               "off when absent")
    operator.set_defaults(func=_operator)

    worker = add_parser("worker", help="run one model replica (what the worker containers run)")
    worker.add_argument("--config", default=contract.CONFIG_PATH)
    worker.add_argument("--metrics-port", type=int, default=contract.METRICS_PORT)
    worker.add_argument("--listen", default="0.0.0.0", metavar="HOST", help="address to serve metrics on")
    worker.add_argument("--keys-dir", default=contract.KEYS_DIR, metavar="DIR",
                        help="the job's CurveZMQ keys; without keys there, no authentication (warned)")
    worker.set_defaults(func=_worker)
    return parser


def _validate(args: argparse.Namespace) -> int:
    from distbelief.operator import errors
    from distbelief.operator.render import sizing
    from distbelief.operator.validation import spec

    failed = False
    for path in args.files:
        try:
            configs = [spec.job_config(spec.validate_job(doc)) for doc in spec.load_manifests(path)]
        except errors.SpecError as exc:
            failed = True
            for line in exc.errors:
                print(f"{path}: {line}", file=sys.stderr)
            continue
        for config in configs:
            for line in sizing.warnings(config.spec):
                print(f"{path}: warning: {line}", file=sys.stderr)
        print(f"{path}: valid")
    return EXIT_INVALID if failed else 0


def _render(args: argparse.Namespace) -> int:
    from distbelief.operator.render import context, render
    from distbelief.operator.validation import spec
    from distbelief.operator.validation.job import DistBeliefJob

    objects = []
    for doc in spec.load_manifests(args.file):
        objects += render.render_children(DistBeliefJob.of(spec.validate_job(doc)),
                                          image=args.image or context.DEFAULT_IMAGE,
                                          operator_namespace=args.operator_namespace)
    sys.stdout.write(render.to_yaml(objects))
    return 0


def _run(args: argparse.Namespace) -> int:
    from distbelief.operator.local import local

    return local.run_file(args.file, output=args.output, progress=not args.no_progress, fresh=args.fresh)


def _reshard(args: argparse.Namespace) -> int:
    from distbelief.operator.local import resharding

    done = resharding.reshard_folder(args.output, args.shards)
    print(done if isinstance(done, str) else done.announcement())
    return 0


def _reshard_claims(args: argparse.Namespace) -> int:
    from distbelief.runtime.roles import reshard

    done = reshard.reshard_claims(args.claims, args.config, args.shards)
    outcome = done if isinstance(done, str) else done.announcement()
    print(outcome)
    if args.message_file:
        with open(args.message_file, "w", encoding="utf-8") as f:
            f.write(outcome)
    return 0


def _predict(args: argparse.Namespace) -> int:
    import numpy as np

    from distbelief.operator import predict

    trained = predict.load(args.file, output=args.output, best=args.best)
    if args.data is None:
        loss, accuracy = trained.evaluate()
        print(f"held-out accuracy {accuracy:.4f}  loss {loss:.4f}  ({len(trained.dataset.y_test)} examples)")
        return 0
    labels, known = predict.predict_source(trained, args.data)
    if known is not None:
        print(f"{args.data}: accuracy {float(np.mean(labels == known)):.4f}  ({len(labels)} examples)")
    if args.out:
        predict.write_predictions(args.out, labels)
        print(f"predictions for {len(labels)} examples: {args.out}")
    elif known is None:
        sys.stdout.write("".join(f"{int(label)}\n" for label in labels))
    return 0


def metrics_address(text: str) -> tuple[str, int]:
    """--metrics [HOST:]PORT as (host, port); HOST defaults to every interface."""
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected [HOST:]PORT with PORT 1..65535")
    return host or "0.0.0.0", int(port)


def _operator(args: argparse.Namespace) -> int:
    from distbelief.operator.cluster import process

    process.run(namespaces=args.namespace, standalone=args.standalone, liveness=args.liveness or None,
                peering=args.peering, metrics=args.metrics)
    return 0


def _ps(args: argparse.Namespace) -> int:
    from distbelief.runtime.roles import ps

    return ps.run_ps(config_path=args.config, shard=args.shard, port=args.port, metrics_port=args.metrics_port,
                     listen=args.listen, checkpoint_dir=args.checkpoint_dir, linger=args.linger,
                     keys_dir=args.keys_dir, coordinator_port=args.coordinator_port, bulk_port=args.bulk_port)


def _worker(args: argparse.Namespace) -> int:
    from distbelief.runtime.roles import worker

    return worker.run_worker(config_path=args.config, metrics_port=args.metrics_port, listen=args.listen,
                             keys_dir=args.keys_dir)


if __name__ == "__main__":
    sys.exit(main())
