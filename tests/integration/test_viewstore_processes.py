"""The file view store written by processes at once: of those that read the same version
exactly one wins (threads and the rest of the store: unit/test_viewstore.py)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from distbelief.runtime.shard.copies.viewstore import FileViewStore
from support.views import record


def _claim_in_process(path: str, version: str, i: int, start, wins) -> None:
    start.wait()
    if FileViewStore(path).compare_and_swap(version, record(5, primary=i, holder=str(i))) is not None:
        wins.put(i)


def test_of_processes_that_read_the_same_version_exactly_one_writes(tmp_path: Path) -> None:
    path = str(tmp_path / "shard-0.json")
    version = FileViewStore(path).compare_and_swap("", record(4))
    context = multiprocessing.get_context("spawn")
    start, wins = context.Barrier(6), context.Queue()
    processes = [context.Process(target=_claim_in_process, args=(path, version, i, start, wins)) for i in range(6)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=60)
    winners = [wins.get(timeout=5) for _ in range(wins.qsize())] if not wins.empty() else []
    assert len(winners) == 1, winners
    assert FileViewStore(path).read()[0].primary == winners[0]
