"""Shared fixtures: the real control plane (support/cluster.py), live shards on loopback,
job keys. Helpers shared by tests live in support/
(paths, examples, shards, fire, cli, waiting, ports), never in a test file."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from distbelief.runtime import contract, keys
from distbelief.runtime.wire.layout import Layout
from support.paths import REPO
from support.shards import LiveShards, start_shards

# `control_plane`, `kubectl`, `api`, `helm`, `namespace`, `chart`, `operator`, `chiefs`: the real
# control plane of the cluster tier (support/cluster.py)
pytest_plugins = ["support.cluster"]


def pytest_sessionstart(session: pytest.Session) -> None:
    """The suite tests the installed wheel of this tree, or nothing (support/installed.py)."""
    from support import installed

    problems = installed.mismatches(REPO)
    if problems:
        shown = "\n  ".join(problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else []))
        pytest.exit(f"the installed distbelief is not this tree's wheel; `make install` builds and installs it "
                    f"(make test does it first):\n  {shown}", returncode=3)


@pytest.fixture
def two_shards(tmp_path: Path) -> Iterator[LiveShards]:
    layout = Layout.of([("w", (10, 7)), ("b", (7,))], shards=2)
    initial = np.arange(layout.total, dtype=np.float32) / 100
    live = start_shards(tmp_path, layout, initial, learning_rate=0.5, optimizer="adagrad", checkpoint_every=3600)
    yield live
    live.stop()


@pytest.fixture
def job_keys() -> keys.JobKeys:
    return keys.JobKeys.generate()


@pytest.fixture(params=[True, False], ids=["encrypted", "unencrypted"])
def encrypted(request: pytest.FixtureRequest) -> bool:
    """Both transports of a secured job: CurveZMQ, and PLAIN (spec.parameterServers.encryption false)."""
    return request.param


@pytest.fixture
def private_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A socket folder as local mode gives its roles (DISTBELIEF_SOCKET_DIR, mode 0700), short
    enough for a Unix socket's name wherever the test's own folder is."""
    with tempfile.TemporaryDirectory(prefix="db-sockets-") as folder:
        monkeypatch.setenv(contract.ENV_SOCKET_DIR, folder)
        yield Path(folder)
