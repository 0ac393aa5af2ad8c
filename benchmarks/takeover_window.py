#!/usr/bin/env python
"""The window of reduced protection after a takeover (spec.parameterServers.backups: 2).

    python benchmarks/takeover_window.py [--kills 5] [--json out.json]

A local dense job with two shards and two backups each, pushed to by the copies checker's
clients (copycheck.py), has shard 1's primary killed --kills times, each once all three
copies are in sync again. Every POLL_S the copies' own figures are read: which is primary
and how many copies its in-sync set holds. Figures, under "takeover_window" (median, min
and max over the kills, in seconds from the kill):

  takeover_s          a surviving copy serves as primary
  one_copy_s          the time after the takeover with the new primary alone in its
                      in-sync set: one more fault then loses what came after the newest
                      checkpoint. A takeover keeps the backups that stand where it stands,
                      so this should be about 0.
  two_copies_s        the new primary has its surviving backup in its set (protected
                      against one more fault)
  all_copies_s        the killed copy is back (restored from its checkpoint), caught up,
                      and in the set
  rejoin_s            all_copies_s minus the killed pod's restart (its metrics answer): a
                      copy's catch-up into the set. A takeover that dropped the other backup
                      to a catch-up (as one did before it kept copies in step) would stand
                      alone about this long, the same model and load.
"""
from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import copycheck
from figures import save_group, summarize

POLL_S = 0.02
SHARD = 1
COPIES = 3


def one_kill(cluster: copycheck.Cluster) -> dict[str, float | None]:
    """Kill the shard's primary once its copies are in sync; when each protection level came back."""
    if not cluster.wait_in_sync(180):
        raise RuntimeError("the copies did not come back in sync")
    seen = cluster.in_sync(SHARD) or {}
    (primary,) = [p for p in cluster.copies(SHARD) if seen[p.name].get("role") == copycheck.PRIMARY]
    killed_at = time.monotonic()
    primary.signal(signal.SIGKILL)
    marks: dict[str, float | None] = {"takeover_s": None, "two_copies_s": None, "all_copies_s": None,
                                      "restarted_s": None}
    alone = 0.0
    last = killed_at
    while marks["all_copies_s"] is None and time.monotonic() - killed_at < 180:
        time.sleep(POLL_S)
        now = time.monotonic()
        figures = cluster.seen(SHARD)
        leader = next((f for name, f in figures.items() if f and f.get("role") == copycheck.PRIMARY
                       and name != primary.name), None)
        if marks["restarted_s"] is None and figures.get(primary.name):
            marks["restarted_s"] = now - killed_at
        if leader is not None:
            marks["takeover_s"] = marks["takeover_s"] or now - killed_at
            count = leader.get("copies", 0)
            if count <= 1:
                alone += now - last
            if count >= 2 and marks["two_copies_s"] is None:
                marks["two_copies_s"] = now - killed_at
            if count >= COPIES:
                marks["all_copies_s"] = now - killed_at
        last = now
    restarted, back = marks.pop("restarted_s"), marks["all_copies_s"]
    return {**marks, "one_copy_s": alone if marks["takeover_s"] is not None else None,
            "rejoin_s": back - restarted if back is not None and restarted is not None else None}


def measure(kills: int) -> dict[str, dict]:
    plan = copycheck.Plan(kind="dense", backups=2, seconds=0.0)
    with tempfile.TemporaryDirectory() as output:
        cluster = copycheck.Cluster(plan, output)
        cluster.thread.start()
        stopping, give_up = threading.Event(), threading.Event()
        clients = [copycheck.Client(cluster, i, plan.clients, [], stopping, give_up) for i in range(plan.clients)]
        try:
            if not cluster.wait_in_sync(120):
                raise RuntimeError("the copies never came in sync")
            for client in clients:
                client.start()
            rows = [one_kill(cluster) for _ in range(kills)]
        finally:
            stopping.set()
            give_up.set()
            for client in clients:
                client.join(timeout=30)
            cluster.stop()
    return {key: summarize([row[key] for row in rows]) for key in rows[0]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = measure(args.kills)
    for key, figure in result.items():
        print(f"{key:16} {figure['median']} [{figure['min']}-{figure['max']}]")
    save_group(result, "takeover_window", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
