"""A shard copies' view record, as the view store tests write them."""

from __future__ import annotations

from distbelief.runtime.shard.copies.viewstore import ViewRecord


def record(view: int, primary: int = 0, holder: str = "a") -> ViewRecord:
    return ViewRecord(view=view, primary=primary, in_sync=((primary, holder), (1, "b")), holder=holder, renewed=1.5)
