"""What a test process holds, and how many requests a shard's histogram counted."""

from __future__ import annotations


def rss_bytes() -> int:
    """This process's resident memory (VmRSS), in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def observed(histogram) -> float:
    """How many observations a prometheus histogram holds (its _count sample)."""
    return next(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_count"))
