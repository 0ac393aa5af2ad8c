"""`distbelief run` stopped from outside, as CI, `timeout` or a closed terminal stop it: the
run ends like Ctrl-C, and no pod outlives it, even when it is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from distbelief.operator.local import report

from support.examples import load_example
from support.waiting import eventually

pytestmark = pytest.mark.slow


def _pods_of(output: Path) -> list[int]:
    """The pids of the processes whose command line names the output folder (the pods)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(output).encode() in cmdline and b"distbelief.operator.cli\x00run" not in cmdline:
            pids.append(int(entry.name))
    return pids


def _start_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["training"]["maxSteps"] = 10_000_000
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    output = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-m", "distbelief.operator.cli", "run", str(job), "--output",
                                str(output), "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    history = output / "volumes" / "digits-ps-0" / "checkpoints" / "history.jsonl"
    eventually(lambda: history.exists() and history.read_text().count("\n") >= 2, 90, interval=0.2,
               what="the first evaluations")
    return process, output


def _kill_leftovers(output: Path) -> list[int]:
    left = _pods_of(output)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_suspend_the_run_like_ctrl_c(tmp_path: Path, sig: signal.Signals) -> None:
    process, output = _start_run(tmp_path)
    try:
        process.send_signal(sig)
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
        left = _kill_leftovers(output)
    assert process.returncode == 130
    summary = json.loads((output / report.REPORT_FILE).read_text())
    assert summary["phase"] == "Suspended"
    assert "Suspended" in out.decode()
    assert left == []
    checkpoints = list((output / "volumes" / "digits-ps-1" / "checkpoints").glob("*.ckpt"))
    assert checkpoints, "the shards did not checkpoint on the way out"


def _described(pids: list[int], output: Path) -> str:
    """What each pod left running is and was doing: its command, state and the end of its
    log, with every thread's stack (a role dumps them on SIGUSR2)."""
    for pid in pids:
        os.kill(pid, signal.SIGUSR2)
    time.sleep(1.0)
    lines = []
    for pid in pids:
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
            state = next(line for line in (Path("/proc") / str(pid) / "status").read_text().splitlines()
                         if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        config = next((a.decode() for a in argv if a.endswith(b"job.json")), "")
        pod = Path(config).parent.parent.name  # volumes/<pod>/config/job.json
        log = output / "logs" / f"{pod}.log"
        tail = log.read_text(errors="replace").splitlines()[-60:] if log.exists() else []
        lines.append(f"pid {pid} pod {pod or '?'} {state}:\n" + "\n".join(tail))
    return "\n".join(lines)


def test_pods_die_with_a_sigkilled_run(tmp_path: Path) -> None:
    process, output = _start_run(tmp_path)
    assert len(_pods_of(output)) == 5
    process.kill()
    process.wait()
    try:
        eventually(lambda: not _pods_of(output), 60, interval=0.2, what="the pods to stop after their parent died")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still running:\n{_described(_pods_of(output), output)}") from None
    finally:
        _kill_leftovers(output)
