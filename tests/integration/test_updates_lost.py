"""A shard that comes back behind the updates it had applied (no copies, its checkpoint
older than its state) makes the job say so: the shard counts the gap from the steps its
replicas pulled, the chief reports it, and with spec.training.failOnUpdatesLost the job
ends Failed with reason UpdatesLost instead of Succeeded. With spec.parameterServers.journal
the same kill loses nothing."""

from __future__ import annotations

import copy
import re
import signal
from pathlib import Path

import pytest

from distbelief.operator.local import local
from distbelief.operator.status import scrape
from distbelief.runtime import contract
from support.examples import load_example
from support.localruns import chief_port, run_while, wait_for_step

pytestmark = pytest.mark.slow


def sigkill_shard_1_unsaved(tmp_path: Path, *, journal: bool) -> tuple[int, dict, int]:
    """The digits example (failing on any loss) with no checkpoint before shard 1 is
    SIGKILLed at step 1,500: its exit code, its summary, and shard 1's step at the kill."""
    doc = copy.deepcopy(load_example("digits-mlp.yaml"))
    doc["spec"]["training"].update(maxSteps=6000, failOnUpdatesLost=True)
    doc["spec"]["parameterServers"]["checkpoint"]["everySeconds"] = 3600
    doc["spec"]["parameterServers"]["journal"] = journal
    held = []

    def kill_shard_1(run: local.LocalRun) -> None:
        wait_for_step(chief_port(run), 1500)
        held.append(scrape.read(f"http://127.0.0.1:{run.shards[1].ports[contract.METRICS_PORT_NAME]}/metrics")
                    .global_step or 0)
        run.shards[1].process.send_signal(signal.SIGKILL)

    code, summary = run_while(doc, tmp_path, kill_shard_1)
    return code, summary, held[0]


def test_a_shard_restored_behind_its_applied_updates_fails_a_job_that_asks_with_the_count(tmp_path: Path) -> None:
    code, summary, held = sigkill_shard_1_unsaved(tmp_path, journal=False)
    assert code == 1 and (summary["phase"], summary["reason"].split(":")[0]) == ("Failed", "UpdatesLost"), summary
    (lost,) = [w for w in summary.get("warnings", []) if w["type"] == "UpdatesLost"]
    count = int(lost["message"].split("shard 1 ")[1].split(")")[0].replace(",", ""))
    # The shard restarted from nothing: about what it held when killed is lost (the replicas
    # pulled it a step or so before), never more than it held then and since.
    assert held * 0.9 <= count <= held + 200, (held, lost)
    assert "shard 0" not in lost["message"]
    assert "event=updates_lost shard=1" in (tmp_path / "logs" / "digits-ps-1.log").read_text()


@pytest.mark.heavy
def test_with_a_journal_a_sigkilled_shard_replays_what_it_acknowledged_and_the_job_loses_nothing(tmp_path: Path) -> None:
    """The same kill with spec.parameterServers.journal: the shard comes back from its
    journal to where it stood, and the job, which fails on any loss, succeeds."""
    code, summary, held = sigkill_shard_1_unsaved(tmp_path, journal=True)
    assert (code, summary["phase"]) == (0, "Succeeded"), summary
    assert not [w for w in summary.get("warnings", []) if w["type"] == "UpdatesLost"], summary
    log = (tmp_path / "logs" / "digits-ps-1.log").read_text()
    first, again = re.findall(r"event=journal_replayed shard=1 from_seq=0 commands=(\d+) step=(\d+)", log)
    assert first == ("0", "0") and int(again[1]) >= held > 0, (again, held)   # back where it stood, or further
    assert "event=updates_lost" not in log
