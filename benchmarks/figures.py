"""What every benchmark reports per figure: the median of its runs, with the min and max."""
from __future__ import annotations

import json
import statistics
from pathlib import Path


def summarize(runs: list[float]) -> dict:
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def fmt(s: dict, spec: str = ".2f") -> str:
    """median [min-max], or "failed" for a figure no run produced."""
    if s["median"] is None:
        return "failed"
    return f"{s['median']:{spec}} [{s['min']:{spec}}-{s['max']:{spec}}]"


def save(results: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=2) + "\n")
