"""The view stores of shard copies (shard/copies/viewstore.py): one record per shard, changed
only by compare-and-swap, so that of writers that read the same version exactly one wins.
Writers in processes: integration/test_viewstore_processes.py; the Lease store against a
real API server: cluster/test_cluster_viewstore.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from distbelief.runtime import contract, errors
from distbelief.runtime.shard.copies import stores
from distbelief.runtime.shard.copies.keeper import RENEWALS, Keeper
from distbelief.runtime.shard.copies.viewstore import FileViewStore, MemoryViewStore, StoreUnavailable, ViewRecord
from support.views import record
from support.waiting import eventually


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path):
    return MemoryViewStore() if request.param == "memory" else FileViewStore(str(tmp_path / "views" / "shard-0.json"))


def test_a_write_naming_a_version_that_is_no_longer_current_is_refused(store) -> None:
    assert store.read() == (None, "")
    first = store.compare_and_swap("", record(1))
    assert first and store.read() == (record(1), first)
    assert store.compare_and_swap("", record(2)) is None  # the record exists: a create loses
    second = store.compare_and_swap(first, record(2, primary=1, holder="b"))
    assert second and second != first
    assert store.compare_and_swap(first, record(3)) is None  # stale version
    assert store.read() == (record(2, primary=1, holder="b"), second)


def test_of_threads_that_read_the_same_version_exactly_one_writes(store) -> None:
    _, version = store.read()
    start, wins = threading.Barrier(8), []

    def claim(i: int) -> None:
        start.wait()
        if store.compare_and_swap(version, record(1, primary=i, holder=str(i))) is not None:
            wins.append(i)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.read()[0].primary == wins[0]


def test_an_unreadable_file_is_no_record_one_may_trust(tmp_path: Path) -> None:
    path = tmp_path / "shard-0.json"
    path.write_text('{"version": 3, "record": {"view": "x"}}')
    with pytest.raises(StoreUnavailable):
        FileViewStore(str(path)).read()


def test_the_environment_chooses_the_store(tmp_path: Path) -> None:
    config = contract.JobNames("j")
    chosen = stores.open_store(config, 1, {contract.ENV_VIEW_STORE: f"file:{tmp_path}"})
    assert isinstance(chosen, FileViewStore) and chosen.path == str(tmp_path / "shard-1.json")
    with pytest.raises(errors.ConfigError, match="needs a view store"):
        stores.open_store(config, 0, {})
    with pytest.raises(errors.ConfigError, match="expected file:FOLDER"):
        stores.open_store(config, 0, {contract.ENV_VIEW_STORE: "etcd"})
    with pytest.raises(errors.ConfigError, match="ServiceAccount token"):
        stores.open_store(config, 0, {contract.ENV_VIEW_STORE: "kubernetes", "KUBERNETES_SERVICE_HOST": "10.0.0.1"})


class OutStore(MemoryViewStore):
    """A store that is out: every call fails, and is counted."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def read(self) -> tuple[ViewRecord | None, str]:
        self.calls += 1
        raise StoreUnavailable("out")

    def compare_and_swap(self, version: str, record: ViewRecord) -> str | None:
        self.calls += 1
        raise StoreUnavailable("out")


def test_claims_against_a_store_that_is_out_go_at_the_renewals_rate_not_at_every_decision() -> None:
    """A backup decides every 0.1 s and claims again as soon as a claim failed: a store that
    is out (an API server down) would get a request per decision from every copy."""
    store = OutStore()
    lease = 0.6
    keeper = Keeper(store, shard=0, rank=1, lease_seconds=lease)
    keeper.start()
    try:
        before, began = store.calls, time.monotonic()
        while time.monotonic() - began < 1.2:   # two leases of a serving loop that claims whenever it may
            keeper.claim("", record(2, primary=1))
            eventually(lambda: keeper.claim_outcome() is not None, 5, 0.001, "the claim's outcome")
            time.sleep(0.01)
        calls = store.calls - before
    finally:
        keeper.close(release=False)
    assert 2 <= calls <= 2 * RENEWALS + 2, calls
