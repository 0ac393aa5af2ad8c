"""A shard that comes back behind the updates it had applied (no copies, its checkpoint
older than its state) makes the job say so: the shard counts the gap from the steps its
replicas pulled, the chief reports it, and with spec.training.failOnUpdatesLost the job
ends Failed with reason UpdatesLost instead of Succeeded."""

from __future__ import annotations

import copy
import signal
from pathlib import Path

import pytest

from distbelief.operator.local import local
from distbelief.operator.status import scrape
from distbelief.runtime import contract
from support.examples import load_example
from support.localruns import chief_port, run_while, wait_for_step

pytestmark = pytest.mark.slow


def test_a_shard_restored_behind_its_applied_updates_fails_a_job_that_asks_with_the_count(tmp_path: Path) -> None:
    doc = copy.deepcopy(load_example("digits-mlp.yaml"))
    doc["spec"]["training"].update(maxSteps=6000, failOnUpdatesLost=True)
    doc["spec"]["parameterServers"]["checkpoint"]["everySeconds"] = 3600   # no checkpoint before the kill
    held = []

    def kill_shard_1(run: local.LocalRun) -> None:
        wait_for_step(chief_port(run), 1500)
        held.append(scrape.read(f"http://127.0.0.1:{run.shards[1].ports[contract.METRICS_PORT_NAME]}/metrics")
                    .global_step or 0)
        run.shards[1].process.send_signal(signal.SIGKILL)

    code, summary = run_while(doc, tmp_path, kill_shard_1)
    assert code == 1 and (summary["phase"], summary["reason"].split(":")[0]) == ("Failed", "UpdatesLost"), summary
    (lost,) = [w for w in summary.get("warnings", []) if w["type"] == "UpdatesLost"]
    count = int(lost["message"].split("shard 1 ")[1].split(")")[0].replace(",", ""))
    # The shard restarted from nothing: about what it held when killed is lost (the replicas
    # pulled it a step or so before), never more than it held then and since.
    assert held[0] * 0.9 <= count <= held[0] + 200, (held, lost)
    assert "shard 0" not in lost["message"]
    assert "event=updates_lost shard=1" in (tmp_path / "logs" / "digits-ps-1.log").read_text()
