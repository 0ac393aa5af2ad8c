"""The CPU seconds a tree of processes spends in a window of wall-clock time, and what the
rest of the machine spent beside it: the cost of distribution, measured the same way for
every system (our jobs, torch's, TensorFlow's).

A thread samples /proc every INTERVAL_S: the user and system time of every descendant of a
root process (every thread of each) and the machine's busy time from /proc/stat. A process
that has exited keeps the last time it was seen with, so the tree's total only grows (and
children reaped by their parents are not counted twice through the parents' cutime). A
window's figure interpolates between the samples around its ends, so it needs no
cooperation from the processes measured.
"""
from __future__ import annotations

import bisect
import json
import os
import threading
import time
from pathlib import Path

INTERVAL_S = 0.1
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
UNKNOWN = "?"  # the role of a process gone, or exited and not yet reaped


def _stat(pid: str) -> tuple[int, tuple[int, int], float] | None:
    """(parent pid, (pid, start time): the process's identity, its own CPU seconds)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None  # gone between listing and reading
    # After the command: state, ppid, ..., utime (12th), stime, ..., starttime (20th).
    return int(fields[1]), (int(pid), int(fields[19])), (int(fields[11]) + int(fields[12])) * TICK_S


def role(pid: int) -> str:
    """What a process is, for the breakdown: the subcommand of `distbelief` (run: the local
    supervisor; ps; worker) or of this bench's children (their JSON's job or role), else its program."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return UNKNOWN
    for i, arg in enumerate(argv):
        if arg in ("run", "ps", "worker", "chief") and i and "distbelief" in " ".join(argv[:i]):
            return arg
        if arg == "--child" and i + 1 < len(argv) and argv[i + 1].startswith("{"):
            try:
                child = json.loads(argv[i + 1])
            except ValueError:
                break  # not one of this bench's children: named by its program
            return f"{child.get('job') or child.get('role')}{child.get('rank', child.get('index', ''))}"
    return Path(argv[0]).name if argv[0] else UNKNOWN


def descendants(root: int) -> dict[tuple[int, int], tuple[int, float]]:
    """Every descendant of root now: its identity, its pid and its CPU seconds."""
    stats = {int(pid): s for pid in os.listdir("/proc") if pid.isdigit() and (s := _stat(pid))}
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    found, stack = {}, list(children.get(root, []))
    while stack:
        pid = stack.pop()
        _, identity, cpu = stats[pid]
        found[identity] = pid, cpu
        stack += children.get(pid, [])
    return found


def machine_busy() -> float:
    """CPU seconds every core of the machine has spent busy since boot (not idle or iowait)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) * TICK_S


class TreeMeter:
    """Samples the CPU of root's descendants (by default, this process's) and the machine's
    while in a with-block."""

    def __init__(self, root: int | None = None) -> None:
        self.root = root if root is not None else os.getpid()
        self.seen: dict[tuple[int, int], float] = {}  # every descendant ever seen: its last CPU seconds
        self.roles: dict[tuple[int, int], str] = {}
        self.times: list[float] = []
        self.samples: list[dict[str, float]] = []  # CPU s: "tree", "machine" (busy), and each role's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMeter:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self._sample()

    def _sample(self) -> None:
        for identity, (pid, cpu) in descendants(self.root).items():
            self.seen[identity] = cpu
            # Read again each time: between fork and exec a child still shows its parent's
            # command; an exited one (a zombie) shows none, and keeps the role it had.
            if (now := role(pid)) != UNKNOWN or identity not in self.roles:
                self.roles[identity] = now
        by_role: dict[str, float] = {}
        for identity, cpu in self.seen.items():
            by_role[self.roles[identity]] = by_role.get(self.roles[identity], 0.0) + cpu
        self.samples.append({"tree": sum(self.seen.values()), "machine": machine_busy(), **by_role})
        self.times.append(time.time())

    def _at(self, t: float, column: str) -> float:
        i = min(max(bisect.bisect_left(self.times, t), 1), len(self.times) - 1)
        (t0, t1) = self.times[i - 1:i + 1]
        a, b = self.samples[i - 1].get(column, 0.0), self.samples[i].get(column, 0.0)
        return a if t1 == t0 else a + (b - a) * min(max((t - t0) / (t1 - t0), 0.0), 1.0)

    def window(self, start: float, end: float) -> dict:
        """The tree's CPU seconds in [start, end], by role, its busy cores, and the cores the rest
        of the machine kept busy meanwhile (other work, this bench's own process among it)."""
        if len(self.times) < 2 or not self.times[0] <= start < end <= self.times[-1] + INTERVAL_S:
            raise ValueError(f"window [{start:.1f}, {end:.1f}] not inside the samples")
        used = {column: self._at(end, column) - self._at(start, column) for column in self.samples[-1]}
        cpu, busy = used.pop("tree"), used.pop("machine")
        return {"cpu_s": cpu, "cores": cpu / (end - start), "other_cores": max(0.0, busy - cpu) / (end - start),
                "cpu_s_by_role": {name: seconds for name, seconds in used.items() if seconds > 0}}
