"""How make bench compares systems: the CPU a process tree spends in a window (a real child
burning a known amount of CPU), and the interleaved rounds' per-round ratios, CPU costs and
re-run of a round disturbed by other work (with measures that report set figures)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import peer_rounds
from cpu_meter import TreeMeter
from figures import RunFailed

BURN = """
import json, time
start = time.time()
while time.process_time() < {seconds}:
    pass
print(json.dumps({{"start": start, "end": time.time()}}))
"""


def test_the_meter_counts_a_childs_cpu_in_its_window_and_keeps_it_once_the_child_has_exited() -> None:
    with TreeMeter() as meter:
        out = subprocess.run([sys.executable, "-c", BURN.format(seconds=0.6)], capture_output=True, text=True,
                             check=True).stdout
        burnt = json.loads(out)
    used = meter.window(burnt["start"], burnt["end"])
    assert 0.35 <= used["cpu_s"] <= 0.8, used  # 0.6 s burnt, less start-up, give or take a sample at each end
    assert sum(used["cpu_s_by_role"].values()) == pytest.approx(used["cpu_s"])
    assert 0 < used["cores"] <= 1.05 and used["other_cores"] >= 0
    assert meter.samples[-1]["tree"] >= 0.5  # the exited child still counts in the tree's total
    with pytest.raises(ValueError, match="not inside the samples"):
        meter.window(burnt["start"] - 60, burnt["end"])


def run(examples_per_s: float, cpu: float, other: float = 0.0) -> dict:
    return {"examples_per_s": examples_per_s, "cpu_s_per_1000": cpu, "cores": 1.8, "other_cores": other,
            "cpu_s_per_1000_by_role": {}}


def fixed(*per_round: dict) -> peer_rounds.Measure:
    return lambda index: per_round[index]


def test_ratios_are_taken_round_by_round_and_a_failed_run_leaves_its_round_out(monkeypatch) -> None:
    monkeypatch.setattr(peer_rounds, "settle", lambda: 0.2)
    measures = {
        "compute_bound": fixed(run(20_000, 0.08), run(10_000, 0.16), run(18_000, 0.09)),
        "torch_ddp_gloo": fixed(run(10_000, 0.09), run(10_000, 0.08), run(18_000, 0.09)),
        "tf_ps_dispatch1": fixed(run(5_000, 0.2), run(5_000, 0.2), run(6_000, 0.2)),
        "tf_ps_dispatch8": fixed(run(8_000, 0.1), run(2_500, 0.1), {}),  # the third round's run crashed
        "compute_bound_single_process": fixed(run(24_000, 0.04), run(24_000, 0.04), run(24_000, 0.045)),
    }

    def crashed_in_round_3(index: int, m=measures["tf_ps_dispatch8"]) -> dict:
        if index == 2:
            raise RunFailed("tf crashed", 1)
        return m(index)
    measures["tf_ps_dispatch8"] = crashed_in_round_3
    failures: list[dict] = []
    kept, discarded = peer_rounds.rounds(3, measures, failures)
    assert not discarded and [f["run"] for f in failures] == ["peer round 3 tf_ps_dispatch8"]
    trained = {name: "compute_bound" for name in measures}
    results = peer_rounds.report(kept, discarded, trained)
    # Per round: 2.0, 1.0, 1.0 against DDP; against TF's better setting 2.5, 2.0, 3.0.
    assert results["ratios"]["distbelief_over_torch_ddp"]["runs"] == pytest.approx([2.0, 1.0, 1.0])
    assert results["ratios"]["distbelief_over_tf_ps_best"]["median"] == pytest.approx(2.5)
    assert results["ratios"]["distbelief_over_tf_ps_dispatch1"]["runs"] == pytest.approx([4.0, 2.0, 3.0])
    assert results["cpu_cost"]["compute_bound"]["runs"] == pytest.approx([2.0, 4.0, 2.0])
    assert "compute_bound_single_process" not in results["cpu_cost"]
    assert results["load_at_start"] == [0.2, 0.2, 0.2]


def test_a_round_beside_other_work_is_run_again_and_its_first_try_kept_aside(monkeypatch) -> None:
    monkeypatch.setattr(peer_rounds, "settle", lambda: 0.3)
    tries = iter([run(1_000, 0.1, other=0.9), run(2_000, 0.1, other=0.1)])
    kept, discarded = peer_rounds.rounds(1, {"compute_bound": lambda index: next(tries)}, [])
    assert kept[0]["runs"]["compute_bound"]["examples_per_s"] == 2_000 and kept[0]["disturbed"] is None
    assert discarded[0]["reason"] == "0.90 cores busy with other work beside compute_bound"
