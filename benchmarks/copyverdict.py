"""The verdict on a history of pushes and reads and the shards' final state (copycheck.py):
what was lost, applied twice, or seen to go back, and which reads were stale. Pure
functions, tested on made-up histories.

A history is a list of Ops, one per push a checker client began: its id, when it began
and ended (time.monotonic()), whether every shard acknowledged it, and each shard's step in
its acknowledgement. A read is a pull of every shard's parameters, with when it began and
ended, and each shard's step and count of every id in its reply. The final state is each
shard's count of every id (how many times the push of that id was applied there:
copycheck reads it from the parameters) and its step.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class Op:
    id: int
    start: float
    end: float | None = None
    acked: bool = False
    steps: list[int] | None = None   # each shard's step in its acknowledgement
    error: str | None = None
    kind: str = "push"               # or "held": a partitioned job's step (HOLD, then its commit)
    refused: bool = False            # a held step its commit dropped: applied nowhere


@dataclasses.dataclass
class Read:
    start: float
    end: float
    steps: list[int]        # each shard's step in its reply
    counts: np.ndarray      # counts[s, i]: the applications of push i the reply of shard s showed


def verdict(ops: list[Op], counts: np.ndarray, steps: list[int], *, limit: int, atomic: bool = False) -> dict[str, Any]:
    """counts[s, i]: the applications of push i found on shard s (ids below limit); steps[s]:
    shard s's final step. Lists of ids (at most 20 shown) and totals of each finding. atomic
    (a partitioned job's held steps): every push, indeterminate ones too, is applied on every
    shard or on none, and one whose commit was refused on none."""
    shards = counts.shape[0]
    began = np.zeros(limit, dtype=bool)
    acked = np.zeros(limit, dtype=bool)
    refused = np.zeros(limit, dtype=bool)
    for op in ops:
        began[op.id] = True
        acked[op.id] |= op.acked
        refused[op.id] |= op.refused
    indeterminate = began & ~acked
    lost = np.flatnonzero(acked & (counts < 1).any(axis=0))
    duplicated = np.flatnonzero((counts > 1).any(axis=0))
    phantom = np.flatnonzero(~began & (counts > 0).any(axis=0))
    uneven = counts.min(axis=0) != counts.max(axis=0)
    partial = np.flatnonzero(indeterminate & uneven)
    half_applied = np.flatnonzero(uneven) if atomic else np.empty(0, np.int64)
    applied_though_refused = np.flatnonzero(refused & (counts > 0).any(axis=0))
    applied = counts.sum(axis=1)
    result = {
        "pushes": int(began.sum()), "acknowledged": int(acked.sum()), "indeterminate": int(indeterminate.sum()),
        "lost": _ids(lost), "lost_by_shard": [int(n) for n in (acked & (counts < 1)).sum(axis=1)],
        "duplicated": _ids(duplicated), "phantom": _ids(phantom),
        "partial": _ids(partial), "half_applied": _ids(half_applied),
        "applied_though_refused": _ids(applied_though_refused), "refused": int(refused.sum()),
        "steps": list(map(int, steps)), "applied": list(map(int, applied)),
        "steps_match_applied": [int(s) == int(a) for s, a in zip(steps, applied)],
        "steps_agree": len(set(map(int, steps))) == 1,
        "went_back": went_back(ops, shards),
    }
    result["ok"] = (not lost.size and not duplicated.size and not phantom.size and not half_applied.size
                    and not applied_though_refused.size and all(result["steps_match_applied"])
                    and (result["steps_agree"] or bool(indeterminate.any())) and not result["went_back"])
    return result


def went_back(ops: list[Op], shards: int) -> list[dict[str, Any]]:
    """Acknowledgements that show a shard's step lower than (or equal to) one acknowledged
    before the push began: a step that went back (real-time order, across clients)."""
    done = sorted((op for op in ops if op.acked and op.end is not None and op.steps), key=lambda op: op.end)
    ends = [op.end for op in done]
    best = np.full((len(done) + 1, shards), -1, dtype=np.int64)  # running max of steps over done[:k]
    for k, op in enumerate(done):
        best[k + 1] = np.maximum(best[k], op.steps)
    found = []
    for op in done:
        before = best[bisect.bisect_left(ends, op.start)]
        for shard, step in enumerate(op.steps):
            if step <= before[shard]:
                found.append({"id": op.id, "shard": shard, "step": step, "seen_before": int(before[shard])})
    return found[:20]


def _ids(ids: np.ndarray) -> dict[str, Any]:
    return {"count": int(ids.size), "ids": [int(i) for i in ids[:20]]}


def row_counts(initial: np.ndarray, final: np.ndarray) -> np.ndarray:
    """How many times each row (SGD at learning rate 1, every gradient value -1) was pushed
    to: its move. -1 where the move is not a whole number, the same for every value."""
    moved = final - initial
    n = np.rint(moved.mean(axis=1))
    exact = np.abs(moved - n[:, None]).max(axis=1) < 1e-3
    return np.where(exact & (n >= 0), n, -1).astype(np.int64)


def rows_verdict(ops: list[Op], counts: np.ndarray) -> dict[str, Any]:
    """counts[i]: the applications of push i's row found on the shard that owns key i (-1: the
    row moved by no whole number of pushes)."""
    began = np.zeros(counts.size, dtype=bool)
    acked = np.zeros(counts.size, dtype=bool)
    for op in ops:
        began[op.id] = True
        acked[op.id] |= op.acked
    result = {"lost": _ids(np.flatnonzero(acked & (counts == 0))),
              "duplicated": _ids(np.flatnonzero(counts > 1)),
              "phantom": _ids(np.flatnonzero(~began & (counts != 0))),
              "unreadable": _ids(np.flatnonzero(counts < 0))}
    result["ok"] = not any(result[k]["count"] for k in ("lost", "duplicated", "phantom", "unreadable"))
    return result


READ_FINDINGS = ("stale", "went_back", "dirty", "torn")


def reads_verdict(reads: list[Read], ops: list[Op], final: np.ndarray) -> dict[str, Any]:
    """Each read against what was known before it began and what the shards held at the end
    (final[s, i], as counts in verdict), shard by shard:
    - stale: it misses a push acknowledged before it began;
    - went_back: it misses a push that a read which ended before it began showed;
    - dirty: it shows a push the shard did not hold at the end (a reply showed an update
      that was then lost);
    - torn: its step is not the number of pushes it shows applied.
    Totals, per shard, and the first few of each."""
    shards, limit = final.shape
    acked = sorted((op for op in ops if op.acked and op.end is not None), key=lambda op: op.end)
    by_end = sorted(reads, key=lambda r: r.end)
    known_acked, known_read = np.zeros(limit, dtype=bool), np.zeros((shards, limit), dtype=bool)
    per_shard = {kind: [0] * shards for kind in READ_FINDINGS}
    first: dict[str, list[dict[str, Any]]] = {kind: [] for kind in READ_FINDINGS}
    next_ack = next_read = 0
    for read in sorted(reads, key=lambda r: r.start):
        while next_ack < len(acked) and acked[next_ack].end < read.start:  # type: ignore[operator]
            known_acked[acked[next_ack].id] = True
            next_ack += 1
        while next_read < len(by_end) and by_end[next_read].end < read.start:
            known_read |= by_end[next_read].counts > 0
            next_read += 1
        seen = read.counts > 0
        for shard in range(shards):
            found = {"stale": known_acked & ~seen[shard], "went_back": known_read[shard] & ~seen[shard],
                     "dirty": seen[shard] & (final[shard] < 1),
                     "torn": np.array([read.steps[shard] != int(read.counts[shard].sum())])}
            for kind, ids in found.items():
                if ids.any():
                    per_shard[kind][shard] += 1
                    if len(first[kind]) < 5:
                        first[kind].append({"read_began": read.start, "shard": shard, "step": read.steps[shard],
                                            "ids": [int(i) for i in np.flatnonzero(ids)[:10]] if kind != "torn" else []})
    result: dict[str, Any] = {"reads": len(reads)}
    for kind in READ_FINDINGS:
        result[kind] = {"count": sum(per_shard[kind]), "by_shard": per_shard[kind], "first": first[kind]}
    result["ok"] = not any(result[kind]["count"] for kind in READ_FINDINGS)
    return result
