"""The highest view a copy of a shard has been in, kept beside its checkpoints.

The view store's record can be deleted: a Lease removed by hand or by a clean-up of a
namespace's leases, a local run's view folder wiped. The next claim would then start again
at view 1, and one view number would name two histories: a primary cut off in the old one
would have its forwards applied by a backup of the new one that reached the same number.
So every claim takes a view above any this copy was ever in (this file, which outlives its
process) and any a live copy reports (replication.Copies._claim): a number once used is
never used again while a copy that used it, or its volume, remains.
"""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger(__name__)

FILE = "view-epoch.json"


class ViewEpoch:
    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, FILE)
        self.highest = self._read()

    def _read(self) -> int:
        try:
            with open(self.path, encoding="utf-8") as f:
                view = json.load(f)["view"]
            if isinstance(view, int) and view >= 0:
                return view
            raise ValueError(f"view {view!r}")
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # the live copies' views still bound the next claim (replication.Copies._claim)
            log.warning("event=view_epoch_unreadable path=%s reason=%r", self.path, str(exc))
            return 0

    def remember(self, view: int) -> None:
        """Keep view if it is the highest yet, durably (written whole, then renamed over)."""
        if view <= self.highest:
            return
        self.highest = view
        temporary = f"{self.path}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(temporary, "w", encoding="utf-8") as f:
                json.dump({"view": view}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, self.path)
        except OSError as exc:
            log.warning("event=view_epoch_not_saved path=%s view=%d reason=%r", self.path, view, str(exc))
