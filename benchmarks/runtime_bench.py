#!/usr/bin/env python
"""Parameter-server micro-benchmarks: memcpy, the shard's update rules, and pull/push
against live shards in their own processes on loopback.

    python benchmarks/runtime_bench.py [--repeats 5] [--params 10000000] [--json benchmarks/results.json]

Every figure is in GB/s = (bytes of the float32 parameter array, 4 * params) / seconds,
with GB = 1e9 bytes. That is the payload a pull or push moves; it is *not* the memory
traffic: np.copyto reads and writes the array (2x), Adagrad streams five arrays
(grad, accumulator and params read, accumulator and params written), SGD three.

Each figure is the median, min and max over --repeats timed runs per client process;
one warm-up run before them is discarded. A run times --calls back-to-back calls and
reports the per-call rate. Each variant's client process is run --rounds times,
alternating with the other variant, and the runs are pooled (repeats*rounds runs).

Layout of one invocation:
  orchestrator (this process, no measurement)
    -> for each environment variant ("default": the GLIBC_TUNABLES every role runs with,
       contract.ROLE_ENV; "glibc": GLIBC_TUNABLES unset) one client process
       (this script with --role client), which measures memcpy/apply locally, then for
       1 and 2 shards starts one benchmarks/_shard_server.py process per shard (same
       environment) and drives them with a real ShardGroup; then 2 shards again with the
       job's keys, once as a job runs by default (CurveZMQ handshake, AES-256-GCM
       sessions for the messages: pull_gbps_encrypted) and once with CurveZMQ for every
       message (pull_gbps_curvezmq).
So the shards never share the client's GIL, and each process starts with its tunables.
OPENBLAS_* variables are passed through untouched.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

try:
    import distbelief.runtime.client.group  # noqa: F401
except ImportError:  # running from a checkout without the editable install
    sys.path[:0] = [str(REPO / "runtime")]

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
import zmq

from distbelief.runtime import contract, keys
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.params import optim
from distbelief.runtime.params.dense_client import Float32Dense
from distbelief.runtime.transport import zmq_transport
from distbelief.runtime.wire.layout import Layout
from distbelief.runtime.wire.protocol import Status

from figures import summarize

# "default" is what a job's roles run with; "glibc" is the allocator left as it comes.
VARIANTS = {"default": contract.ROLE_ENV["GLIBC_TUNABLES"], "glibc": None}
perf = time.perf_counter


# -- measurement helpers ------------------------------------------------------------

def rate_runs(fn: Callable[[], None], nbytes: int, repeats: int, calls: int) -> list[float]:
    """GB/s of nbytes per call; one warm-up run, then `repeats` timed runs of `calls` calls."""
    out = []
    for run in range(repeats + 1):
        started = perf()
        for _ in range(calls):
            fn()
        elapsed = (perf() - started) / calls
        if run:  # run 0 is the warm-up
            out.append(nbytes / elapsed / 1e9)
    return out


def minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# -- local (single-process) figures ---------------------------------------------------

def cipher_figures(plain: np.ndarray, repeats: int, calls: int) -> dict:
    """One core's AES-256-GCM seal and open of `plain` into warm buffers, with the calls the
    bulk channel makes per frame (encrypt_into, decrypt_into): the bound an encrypted pull or
    push on this machine is held to, beside memcpy's."""
    aead = AESGCM(AESGCM.generate_key(bit_length=256))
    nonce, nbytes, plain = bytes(12), plain.nbytes, memoryview(plain).cast("B")
    sealed = bytearray(nbytes + 16)
    opened = bytearray(nbytes)
    aead.encrypt_into(nonce, plain, None, sealed)
    return {"aes_gcm_seal_gbps": rate_runs(lambda: aead.encrypt_into(nonce, plain, None, sealed), nbytes, repeats,
                                           calls),
            "aes_gcm_open_gbps": rate_runs(lambda: aead.decrypt_into(nonce, sealed, None, opened), nbytes, repeats,
                                           calls)}


def local_figures(params: int, repeats: int, calls: int) -> dict:
    rng = np.random.default_rng(0)
    nbytes = params * 4
    src = rng.standard_normal(params, dtype=np.float32)
    dst = np.empty_like(src)
    dst[...] = 0  # fault it in before timing
    figures = {"memcpy_gbps": rate_runs(lambda: np.copyto(dst, src), nbytes, repeats, calls)}

    grad = (rng.standard_normal(params, dtype=np.float32) * 1e-3)
    weights = np.zeros(params, dtype=np.float32)
    adagrad = optim.Adagrad(params, 0.01)
    figures["apply_gbps"] = rate_runs(lambda: adagrad.apply(weights, grad), nbytes, repeats, calls)
    sgd = optim.Sgd(params, 0.01)
    figures["sgd_apply_gbps"] = rate_runs(lambda: sgd.apply(weights, grad), nbytes, repeats, calls)

    figures.update(cipher_figures(src, repeats, calls))

    # Pieces of a push on the shard, to explain the push figure.
    # 1) the finiteness check the shard runs before applying (np.dot -> BLAS sdot).
    figures["finite_check_gbps"] = rate_runs(lambda: np.isfinite(np.dot(grad, grad)), nbytes, repeats, calls)

    # 2) writing the payload into a *fresh* malloc'd buffer, as libzmq's decoder does for
    #    every large incoming message (malloc + first-touch page faults + free), vs memcpy
    #    into a warm buffer. Half the model = one of two shards' slices; the whole = one shard.
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    source = src.ctypes.data

    def fresh_copy(size: int) -> Callable[[], None]:
        def run() -> None:
            buf = libc.malloc(size)
            ctypes.memmove(buf, source, size)
            libc.free(buf)
        return run

    for label, size in (("whole", nbytes), ("half", nbytes // 2)):
        before = minflt()
        figures[f"fresh_malloc_copy_{label}_gbps"] = rate_runs(fresh_copy(size), size, repeats, calls)
        figures[f"fresh_malloc_copy_{label}_minflt_per_call"] = (minflt() - before) / ((repeats + 1) * calls)
    return figures


# -- live shards ------------------------------------------------------------------------

class ShardProcesses:
    def __init__(self, params: int, shards: int, security: list[str]) -> None:
        self.procs = []
        for index in range(shards):
            self.procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "_shard_server.py"), "--shard", str(index),
                 "--shards", str(shards), "--params", str(params), *security],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        self.addresses = []
        for proc in self.procs:
            line = proc.stdout.readline().strip()
            if not line.startswith("tcp://"):
                self.stop()
                raise RuntimeError(f"shard server did not start: {line!r}")
            self.addresses.append(line)

    def stop(self) -> list[dict]:
        reports = []
        for proc in self.procs:
            if proc.stdin and not proc.stdin.closed:
                proc.stdin.close()
        for proc in self.procs:
            out = proc.stdout.read()
            proc.wait(timeout=120)
            for line in out.splitlines():
                if line.startswith("{"):
                    reports.append(json.loads(line))
        return reports


def shard_figures(params: int, shards: int, repeats: int, calls: int, io_threads: int = 1,
                  encryption: str | None = None) -> dict:
    """encryption: None (no keys), "curve" (CurveZMQ for everything) or "sessions" (CurveZMQ
    for the handshake, the AES-GCM bulk channel for the messages: the default of a job)."""
    layout = Layout.of([("w", (params,))], shards=shards)
    nbytes = params * 4
    folder = tempfile.mkdtemp(prefix="db-bench-keys-")
    job_keys = keys.JobKeys.generate()
    job_keys.write(folder + "/keys")
    security = [] if encryption is None else ["--keys", folder + "/keys"] + (
        ["--sessions"] if encryption == "sessions" else [])
    servers = ShardProcesses(params, shards, security)
    context = zmq.Context(io_threads=io_threads)
    group = ShardGroup(servers.addresses, layout, timeouts=Timeouts(request=30.0, unavailable=120.0),
                       transport_=zmq_transport.ZmqTransport(context),
                       security=job_keys.client_options() if encryption else None)
    try:
        assert all(r.header.status == Status.OK for r in group.hello())
        out = np.empty(layout.total, dtype=np.float32)
        out[...] = 0
        grad = np.random.default_rng(1).standard_normal(layout.total, dtype=np.float32) * 1e-3
        steps = [0] * shards

        def pull() -> None:
            replies = Float32Dense(group).pull(out)
            assert all(r.header.status == Status.OK for r in replies), replies
            steps[:] = [r.header.step for r in replies]

        def push() -> None:
            replies = Float32Dense(group).push(grad, steps=steps, examples=1, loss=0.0)
            assert all(r.header.status == Status.OK for r in replies), replies

        def timed_with_faults(fn: Callable[[], None]) -> tuple[list[float], float]:
            before = minflt()
            runs = rate_runs(fn, nbytes, repeats, calls)
            return runs, (minflt() - before) / ((repeats + 1) * calls)

        pull_runs, pull_faults = timed_with_faults(pull)
        push_runs, push_faults = timed_with_faults(push)
        # Client-side splits of one push and one pull, over a few extra calls.
        push_split = []
        for _ in range(calls * 2):
            started = perf()
            push()
            push_split.append(perf() - started)
        pull_split = []
        for _ in range(calls * 2):
            started = perf()
            pull()
            pull_split.append(perf() - started)
    finally:
        group.close()
        context.term()
        reports = servers.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return {"pull_gbps": pull_runs, "push_gbps": push_runs,
            "client_minflt_per_pull": pull_faults, "client_minflt_per_push": push_faults,
            "client_pull_s": statistics.median(pull_split), "client_push_s": statistics.median(push_split),
            "shard_splits": {str(r["shard"]): r["splits"] for r in reports}}


def client_main(args: argparse.Namespace) -> int:
    result = {"local": local_figures(args.params, args.repeats, args.calls)}
    for shards in (1, 2):
        result[f"shards_{shards}"] = shard_figures(args.params, shards, args.repeats, args.calls)
    if args.io_threads_probe:
        result["shards_2_io2"] = shard_figures(args.params, 2, args.repeats, args.calls, io_threads=2)
    for encryption in ("curve", "sessions"):
        result[f"shards_2_{encryption}"] = shard_figures(args.params, 2, args.repeats, args.calls,
                                                         encryption=encryption)
    print(json.dumps(result), flush=True)
    return 0


# -- orchestration and report --------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_variant(name: str, tunables: str | None, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", "client", "--params", str(args.params),
           "--repeats", str(args.repeats), "--calls", str(args.calls)]
    if not args.io_threads_probe:
        cmd.append("--no-io-threads-probe")
    print(f"[{name}] running client + shard processes (GLIBC_TUNABLES={tunables or 'unset'}) ...",
          file=sys.stderr, flush=True)
    started = perf()
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    print(f"[{name}] done in {perf() - started:.1f} s", file=sys.stderr, flush=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def fmt(s: dict) -> str:
    return f"{s['median']:6.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def merge(results: list):
    """Pool rounds: lists of runs are concatenated, scalars averaged, dicts merged key by key."""
    first = results[0]
    if isinstance(first, dict):
        return {k: merge([r[k] for r in results if k in r]) for k in first}
    if isinstance(first, list):
        return [x for r in results for x in r]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(results) / len(results)
    return first


def encrypted_bound(figures: dict) -> list[float]:
    """Per run, what an encrypted pull or push can reach on 2 cores: the receiving process
    opens every byte on one core while the shards seal them on the other, so the slower of
    one core's seal and open bounds it."""
    return [min(seal, opened) for seal, opened in zip(figures["aes_gcm_seal_gbps"]["runs"],
                                                       figures["aes_gcm_open_gbps"]["runs"])]


def build_report(raw: dict[str, dict], args: argparse.Namespace) -> dict:
    variants = {}
    for name, res in raw.items():
        local = res["local"]
        figures = {k: summarize(v) for k, v in local.items() if k.endswith("_gbps")}
        figures.update({k: v for k, v in local.items() if not k.endswith("_gbps")})
        for key in [k for k in res if k.startswith("shards_")]:
            shard = res[key]
            figures[f"pull_gbps_{key}"] = summarize(shard["pull_gbps"])
            figures[f"push_gbps_{key}"] = summarize(shard["push_gbps"])
            figures[f"detail_{key}"] = {k: v for k, v in shard.items() if not k.endswith("_gbps")}
        variants[name] = figures
    main = variants["default"]
    report = {
        "memcpy_gbps": main["memcpy_gbps"],
        "apply_gbps": main["apply_gbps"],
        "sgd_apply_gbps": main["sgd_apply_gbps"],
        "pull_gbps": main["pull_gbps_shards_2"],
        "push_gbps": main["push_gbps_shards_2"],
        "pull_gbps_encrypted": main["pull_gbps_shards_2_sessions"],
        "push_gbps_encrypted": main["push_gbps_shards_2_sessions"],
        "pull_gbps_curvezmq": main["pull_gbps_shards_2_curve"],
        "push_gbps_curvezmq": main["push_gbps_shards_2_curve"],
        "aes_gcm_seal_gbps": main["aes_gcm_seal_gbps"],
        "aes_gcm_open_gbps": main["aes_gcm_open_gbps"],
        "aes_gcm_bound_gbps": summarize(encrypted_bound(main)),
        "definition": "GB/s = 4*params bytes (the float32 parameter array) per second per call, GB = 1e9 B; "
                      "median/min/max over `repeats` runs of `calls` calls each, one warm-up run excluded. "
                      "Top-level pull/push: 2 shard processes, the roles' GLIBC_TUNABLES, no keys; "
                      "_encrypted: with the job's keys as a job runs by default (CurveZMQ handshake, "
                      "AES-256-GCM sessions for the messages); _curvezmq: CurveZMQ for every message.",
        "variants": variants,
        "metadata": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "numpy": np.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
            "python": platform.python_version(), "cpu_model": cpu_model(), "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "glibc": platform.libc_ver()[1],
            "params": args.params, "bytes": args.params * 4, "repeats": args.repeats, "calls": args.calls,
            "rounds": args.rounds, "runs_per_figure": args.repeats * args.rounds,
            "loadavg_at_start": args.load_at_start, "loadavg_at_end": _read("/proc/loadavg"),
            "cpu_pressure_at_end": _read("/proc/pressure/cpu"),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        },
    }
    return report


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "unknown"


def print_table(report: dict) -> None:
    variants = report["variants"]
    names = list(variants)
    rows = [("memcpy (np.copyto)", "memcpy_gbps"), ("Adagrad apply", "apply_gbps"),
            ("SGD apply", "sgd_apply_gbps"), ("finite check (np.dot)", "finite_check_gbps"),
            ("fresh malloc+copy, whole", "fresh_malloc_copy_whole_gbps"),
            ("fresh malloc+copy, half", "fresh_malloc_copy_half_gbps"),
            ("pull, 1 shard", "pull_gbps_shards_1"), ("push, 1 shard", "push_gbps_shards_1"),
            ("pull, 2 shards", "pull_gbps_shards_2"), ("push, 2 shards", "push_gbps_shards_2"),
            ("pull, 2 shards, 2 io thr", "pull_gbps_shards_2_io2"),
            ("push, 2 shards, 2 io thr", "push_gbps_shards_2_io2")]
    meta = report["metadata"]
    print(f"\nload average at start: {meta['loadavg_at_start']}; at end: {meta['loadavg_at_end']}")
    print(f"{meta['params']:,} float32 parameters ({meta['bytes'] / 1e6:.0f} MB); GB/s of array bytes, "
          f"median [min-max] of {meta['runs_per_figure']} runs "
          f"({meta['rounds']} rounds x {meta['repeats']}) x {meta['calls']} calls")
    print(f"{'figure':28s}" + "".join(f"{n:>26s}" for n in names) + "   ratio to memcpy")
    for label, key in rows:
        if key not in variants[names[0]]:
            continue
        cells = "".join(f"{fmt(variants[n][key]):>26s}" for n in names)
        ratios = " / ".join(f"{variants[n][key]['median'] / variants[n]['memcpy_gbps']['median']:.2f}"
                            for n in names)
        print(f"{label:28s}{cells}   {ratios}")
    print("\nminor page faults per call (client process):")
    for n in names:
        for key in ("shards_1", "shards_2"):
            d = variants[n][f"detail_{key}"]
            print(f"  {n:8s} {key}: pull {d['client_minflt_per_pull']:.0f}, push {d['client_minflt_per_push']:.0f}")
        print(f"  {n:8s} fresh malloc+copy: whole {variants[n]['fresh_malloc_copy_whole_minflt_per_call']:.0f}, "
              f"half {variants[n]['fresh_malloc_copy_half_minflt_per_call']:.0f}")
    print("\nshard-side splits (median per request, ms; minflt = faults in the shard process per request):")
    for n in names:
        for key in [k for k in variants[n] if k.startswith("detail_")]:
            d = variants[n][key]
            for shard, splits in sorted(d["shard_splits"].items()):
                for op, s in splits.items():
                    parts = ", ".join(f"{k[:-2]} {v * 1e3:.2f}" for k, v in s.items() if k.endswith("_s"))
                    rest = s["handle_s"] - s["handler_s"] - s.get("recv_s", 0) - s.get("send_s", 0)
                    parts += f", rest-of-handle {rest * 1e3:.2f}"
                    print(f"  {n:8s} {key[7:]:12s} shard {shard} {op:4s}: {parts}, minflt {s.get('minflt', 0):.0f}")
            print(f"  {n:8s} {key[7:]:12s} client round trip: pull {d['client_pull_s'] * 1e3:.2f} ms, "
                  f"push {d['client_push_s'] * 1e3:.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (after one warm-up)")
    parser.add_argument("--calls", type=int, default=5, help="calls per run")
    parser.add_argument("--rounds", type=int, default=2,
                        help="client processes per variant, run alternately; their runs are pooled "
                             "(so each figure has repeats*rounds runs)")
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    parser.add_argument("--variants", default="default,glibc", help="comma list of: " + ",".join(VARIANTS))
    parser.add_argument("--no-io-threads-probe", dest="io_threads_probe", action="store_false",
                        help="skip the extra 2-shard run with a 2-I/O-thread client context")
    parser.add_argument("--role", default="orchestrator", choices=["orchestrator", "client"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.repeats, args.calls, args.rounds) < 1:
        parser.error("--repeats, --calls and --rounds must be at least 1")
    if args.role == "client":
        return client_main(args)
    args.load_at_start = _read("/proc/loadavg")
    load1 = float(args.load_at_start.split()[0]) if args.load_at_start != "unknown" else 0.0
    if load1 > 0.5:
        print(f"warning: load average {load1:.2f} at start: other work shares the "
              f"{os.cpu_count()} CPUs and will depress and scatter the figures", file=sys.stderr)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    if "default" not in names:
        names.insert(0, "default")
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(args.rounds):  # alternate the variants so drift hits both alike
        for name in names:
            rounds[name].append(run_variant(f"{name} {round_index + 1}/{args.rounds}", VARIANTS[name], args))
    raw = {name: merge(results) for name, results in rounds.items()}
    report = build_report(raw, args)
    print_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
