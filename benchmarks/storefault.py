"""A view store outage, for the copies checker (copycheck.py): a local run's view record
(views/shard-<i>.json) swapped with an empty folder for a while, then swapped back.

Both swaps are one renameat2(RENAME_EXCHANGE) each, so the record is never missing: a
copy that read no record would take it for deleted, which is another fault. Meanwhile
every read and every compare-and-swap of the shard's copies fails (StoreUnavailable), as on
a cluster whose API server is down: the primary cannot renew its lease, and no backup can
take over.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Iterator

AT_FDCWD = -100
RENAME_EXCHANGE = 2
_LIBC = ctypes.CDLL(None, use_errno=True)


def exchange(a: str, b: str) -> None:
    """Swap two paths atomically (Linux 3.15 and later)."""
    if _LIBC.renameat2(AT_FDCWD, a.encode(), AT_FDCWD, b.encode(), RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"renameat2 {a} <-> {b}: {os.strerror(code)}")


@contextlib.contextmanager
def outage(record: str) -> Iterator[None]:
    """The store of record unreadable and unwritable for the block."""
    hole = record + ".outage"
    os.mkdir(hole)
    try:
        exchange(hole, record)
        try:
            yield
        finally:
            exchange(hole, record)
    finally:
        os.rmdir(hole)
