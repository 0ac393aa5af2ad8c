"""`kubectl-distbelief --local DIR` on a real local run: get, describe, top and logs while it
trains, a followed log that ends with the run, and how the run ended once it has."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.examples import load_example
from support.plugin import columns, command, environment, run_plugin
from support.waiting import eventually

pytestmark = pytest.mark.slow


def plugin(*args: str) -> str:
    done = run_plugin(*args)
    assert done.returncode == 0, f"kubectl-distbelief {' '.join(args)}: exit {done.returncode}\n{done.stderr}"
    return done.stdout


def test_a_local_run_seen_while_it_trains_and_after_ctrl_c(tmp_path: Path) -> None:
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["training"]["maxSteps"] = 10_000_000
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    output = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-m", "distbelief.operator.cli", "run", str(tmp_path / "job.yaml"),
                            "--output", str(output), "--no-progress"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    local = ("--local", str(output))
    try:
        def evaluated() -> list[dict[str, str]]:  # the chief may evaluate before the first step counts
            rows = columns(plugin("get", *local)) if (output / "status.json").exists() else []
            return rows if rows and rows[0]["ACCURACY"] != "-" and rows[0]["STEP"] not in ("-", "0") else []

        (row,) = eventually(evaluated, 90, interval=0.3, what="the run stepping with a held-out accuracy")
        assert (row["NAME"], row["PHASE"]) == ("digits", "Running"), row
        described = plugin("describe", "digits", *local)
        assert re.search(r"^Phase: +Running \(Training: 2 shards and 3 replicas ready\)$", described, re.M)
        assert re.search(r"^  digits-worker-2 +worker +yes +0 +Running$", described, re.M), described

        def stepping() -> list[dict[str, str]]:  # every pod read and moving (a loaded machine may stall one)
            rows = columns(plugin("top", "digits", "--interval", "0.5", *local))
            return rows if all(re.fullmatch(r"[\d.]+", r["STEPS/S"]) and float(r["STEPS/S"]) > 0 for r in rows) else []

        rows = eventually(stepping, 30, what="every pod stepping")
        assert [r["POD"] for r in rows] == ["digits-ps-0", "digits-ps-1", *(f"digits-worker-{i}" for i in range(3))]
        assert all(r["MEMORY"].endswith("MiB") and r["IN"].endswith("iB") for r in rows), rows

        chief = plugin("logs", "digits", "--role", "chief", *local)
        assert "event=evaluated" in chief and "shard=1" not in chief
        follower = subprocess.Popen(command("logs", "digits", "--role", "worker", "-f", *local),
                                    env=environment(), stdout=subprocess.PIPE, text=True)
        refused = run_plugin("scale", "digits", "5", *local)
        assert refused.returncode == 1 and "scale needs a cluster" in refused.stderr
    finally:
        run.send_signal(signal.SIGINT)
        assert run.wait(60) == 130, run.stdout.read() if run.stdout else ""

    # The follower ends by itself with the run, having printed each replica's lines.
    followed, _ = follower.communicate(timeout=30)
    assert follower.returncode == 0
    assert {line.split("]")[0] for line in followed.splitlines()} == {f"[digits-worker-{i}" for i in range(3)}
    (row,) = columns(plugin("get", *local))
    assert (row["PHASE"], row["ETA"]) == ("Suspended", "-"), row
    described = plugin("describe", "digits", *local)
    assert "Phase:         Suspended (Interrupted: checkpoints kept; run again to resume)" in described
    assert json.loads((output / "report.json").read_text())["phase"] == "Suspended"
    ended = run_plugin("top", "digits", *local)
    assert ended.returncode == 1 and "has no running pods" in ended.stderr


def test_a_folder_without_a_run_is_named_as_such(tmp_path: Path) -> None:
    done = run_plugin("get", "--local", str(tmp_path))
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: {tmp_path}: no status.json; --local takes the output folder of a " \
                                  "`distbelief run` (--output DIR)"
