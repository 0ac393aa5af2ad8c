"""Where a shard's copies agree on who is primary: one record per shard in a linearizable
store, changed only by compare-and-swap.

    ViewRecord    the view number, the primary's rank, the in-sync set (rank and
                  incarnation of each copy that holds every acknowledged update, the
                  primary included), the lease's holder and when it last renewed (as the
                  holder's wall clock says: for people; copies judge expiry by their own
                  clocks), and how many failovers the shard had
    ViewStore     read() -> (record or None, version); compare_and_swap(version, record)
                  -> the new version, or None when the version is no longer current
                  (someone else wrote first); StoreUnavailable when it cannot tell

Two stores keep this promise: FileViewStore, a file per shard changed under an exclusive
flock and replaced atomically (local mode: every copy on one machine), and
kubelease.LeaseViewStore, a coordination.k8s.io Lease per shard whose resourceVersion is
the version (on a cluster). MemoryViewStore is the same in one process, for tests.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import threading
import time
from typing import Any, Protocol

from distbelief.runtime import errors

Member = tuple[int, str]  # (rank, incarnation) of a copy


class StoreUnavailable(errors.RuntimeFailure):
    """The store did not answer, or answered something unreadable: nothing is known."""


@dataclasses.dataclass(frozen=True)
class ViewRecord:
    view: int
    primary: int
    in_sync: tuple[Member, ...]
    holder: str             # the primary's incarnation
    renewed: float = 0.0    # the holder's wall clock at its last renewal (informational)
    lease_seconds: float = 3.0
    failovers: int = 0      # backups that took over, over the shard's life in this store

    def member(self, rank: int, incarnation: str) -> bool:
        return (rank, incarnation) in self.in_sync

    def ranks(self) -> set[int]:
        return {rank for rank, _ in self.in_sync}

    def to_json(self) -> dict[str, Any]:
        return {"view": self.view, "primary": self.primary, "inSync": [list(m) for m in self.in_sync],
                "holder": self.holder, "renewed": self.renewed, "leaseSeconds": self.lease_seconds,
                "failovers": self.failovers}

    @classmethod
    def from_json(cls, value: Any) -> ViewRecord:
        try:
            record = cls(view=int(value["view"]), primary=int(value["primary"]),
                         in_sync=tuple((int(r), str(i)) for r, i in value["inSync"]), holder=str(value["holder"]),
                         renewed=float(value.get("renewed", 0.0)), lease_seconds=float(value.get("leaseSeconds", 3.0)),
                         failovers=int(value.get("failovers", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreUnavailable(f"an unreadable view record: {str(value)[:200]}") from exc
        return record


class ViewStore(Protocol):
    """A linearizable register holding one ViewRecord, with versions."""

    def read(self) -> tuple[ViewRecord | None, str]:
        """The record (None before the first write) and its version ("" then)."""
        ...

    def compare_and_swap(self, version: str, record: ViewRecord) -> str | None:
        """Write record if version is still the current one; its new version, else None."""
        ...

    def describe(self) -> str: ...


class MemoryViewStore:
    """The register in this process (tests of copies serving in threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._record: ViewRecord | None = None
        self._version = 0

    def read(self) -> tuple[ViewRecord | None, str]:
        with self._lock:
            return self._record, str(self._version) if self._record is not None else ""

    def compare_and_swap(self, version: str, record: ViewRecord) -> str | None:
        with self._lock:
            current = str(self._version) if self._record is not None else ""
            if version != current:
                return None
            self._record, self._version = record, self._version + 1
            return str(self._version)

    def describe(self) -> str:
        return "memory"


class FileViewStore:
    """One JSON file per shard: {"version": n, "record": {...}}. A compare-and-swap holds an
    exclusive flock on a lock file beside it while it reads, compares and writes a temporary
    that replaces the file (os.replace is atomic: a reader sees the old file or the new one,
    whole). Every copy runs on this machine (local mode), so flock is enough; the file is not
    fsynced (a machine crash ends every copy anyway). A lock its holder keeps (frozen in the
    middle of a write) makes the store unavailable, not the waiter stuck."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock_path = path + ".lock"
        folder = os.path.dirname(path) or "."
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise errors.ConfigError(f"cannot create the view store folder {folder}: {exc}") from exc

    def describe(self) -> str:
        return f"file {self.path}"

    def read(self) -> tuple[ViewRecord | None, str]:
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return None, ""
        except OSError as exc:
            raise StoreUnavailable(f"cannot read {self.path}: {exc}") from exc
        return _parse(text, self.path)

    def compare_and_swap(self, version: str, record: ViewRecord) -> str | None:
        try:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StoreUnavailable(f"cannot open {self._lock_path}: {exc}") from exc
        try:
            _locked(fd)
            _, current = self.read()
            if current != version:
                return None
            new = str(int(current or 0) + 1)
            temporary = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(temporary, "w", encoding="utf-8") as f:
                json.dump({"version": int(new), "record": record.to_json()}, f)
            os.replace(temporary, self.path)
            return new
        except OSError as exc:
            raise StoreUnavailable(f"cannot write {self.path}: {exc}") from exc
        finally:
            os.close(fd)  # releases the flock


LOCK_SECONDS = 1.0  # a flock held longer (its holder frozen mid-write): the store is unavailable for now


def _locked(fd: int) -> None:
    """Take the exclusive flock, or StoreUnavailable after LOCK_SECONDS (never block for good
    on a holder that was frozen while it held it)."""
    deadline = time.monotonic() + LOCK_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise StoreUnavailable(f"the view store's lock has been held for over {LOCK_SECONDS} s") from None
            time.sleep(0.005)


def _parse(text: str, where: str) -> tuple[ViewRecord | None, str]:
    try:
        value = json.loads(text)
        version, record = str(int(value["version"])), value["record"]
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreUnavailable(f"{where} holds no view record: {exc}") from exc
    return ViewRecord.from_json(record), version
