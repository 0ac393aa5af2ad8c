"""Shared fixtures: validated example jobs, and live shards on loopback in this process."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import prometheus_client as prom
import pytest

from distbelief.operator.local import local
from distbelief.operator.spec import spec
from distbelief.runtime import jobspec, keys
from distbelief.runtime.algorithms.downpour.updates import DownpourUpdates
from distbelief.runtime.client.group import ShardGroup, Timeouts
from distbelief.runtime.observe.metrics import ShardMetrics
from distbelief.runtime.params.dense import DenseSlice
from distbelief.runtime.shard.core import Shard, ShardSettings
from distbelief.runtime.wire.layout import Layout

# `control_plane`, `kubectl`, `api`, `helm`, `namespace`, `chart`, `operator`, `chiefs`: the real
# control plane of the cluster tier (support/cluster.py); `kube`: the Kubernetes API emulator on
# loopback that benchmarks/operator_bench.py measures the operator against (tests/kube)
pytest_plugins = ["kube.plugin", "support.cluster"]

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def pytest_sessionstart(session: pytest.Session) -> None:
    """The suite tests the installed wheel of this tree, or nothing (support/installed.py)."""
    from support import installed

    problems = installed.mismatches(REPO)
    if problems:
        shown = "\n  ".join(problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else []))
        pytest.exit(f"the installed distbelief is not this tree's wheel; `make install` builds and installs it "
                    f"(make test does it first):\n  {shown}", returncode=3)


def load_example(name: str) -> dict[str, Any]:
    (doc,) = spec.load_manifests(str(EXAMPLES / name))
    return doc


def typed_model(written: dict[str, Any]) -> jobspec.Model:
    """A spec.model as the runtime takes it, resolved from a dict as a job's config is."""
    return jobspec.resolve({"data": {"source": "builtin:digits"}, "model": written}).model


@dataclasses.dataclass
class LiveShards:
    """Shards serving in threads; stop() ends them (each writes a final checkpoint)."""

    layout: Layout
    shards: list[Shard]
    threads: list[threading.Thread]

    @property
    def addresses(self) -> list[str]:
        return [s.endpoint for s in self.shards]

    def group(self, **kwargs: Any) -> ShardGroup:
        kwargs.setdefault("timeouts", Timeouts(request=2.0, unavailable=10.0))
        return ShardGroup(self.addresses, self.layout, **kwargs)

    def params(self, index: int) -> np.ndarray:
        """Shard index's dense slice, as it is now."""
        return self.shards[index].plugin(DenseSlice).params

    def stop(self) -> None:
        for shard in self.shards:
            shard.stop()
        for thread in self.threads:
            thread.join(timeout=10)


def start_shards(folder: Path, layout: Layout, initial: np.ndarray, *,
                 attach: Callable[[Shard], None] = lambda shard: None, **settings: Any) -> LiveShards:
    """Downpour's shards: a dense slice of initial and Downpour's update hook (warm-start with
    warmstart_steps), and whatever attach adds to each."""
    shards, threads = [], []
    warmstart_steps = settings.pop("warmstart_steps", 0)
    optimizer = {"optimizer": settings.pop("optimizer", "adagrad"), "learning_rate": settings.pop("learning_rate", 0.1),
                 "max_gradient_norm": settings.pop("max_gradient_norm", 1e4),
                 "wire_format": settings.pop("wire_format", "float32")}
    for index in range(layout.shards):
        options = {"bind": "tcp://127.0.0.1:*", "checkpoint_dir": str(folder / f"shard-{index}"), **settings}
        shard = Shard(ShardSettings(shard=index, **options), layout, ShardMetrics(prom.CollectorRegistry(), index))
        shard.attach(DenseSlice(shard, initial, **optimizer))
        shard.watch_updates(DownpourUpdates(shard, warmstart_steps=warmstart_steps))
        attach(shard)
        shard.restore()
        thread = threading.Thread(target=shard.serve, daemon=True)
        thread.start()
        assert shard.ready.wait(10), "shard did not start"
        shards.append(shard)
        threads.append(thread)
    return LiveShards(layout, shards, threads)


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
KillRecord = dict[str, Any]


def run_under_fire(doc: dict[str, Any], output: Path,
                   killer: Callable[[local.LocalRun, threading.Thread], list[KillRecord]],
                   ) -> tuple[local.LocalRun, list[int], list[KillRecord]]:
    """Run a job in local mode (in a thread) while killer(run, thread) SIGKILLs its pods; wait
    for the job's end. Returns the run, its exit code (in a list, empty if it never
    ended) and what the killer recorded."""
    run = local.LocalRun(spec.validate_job(doc), str(output))
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run.run(progress=False)), daemon=True)
    thread.start()
    try:
        kills = killer(run, thread)
        thread.join(timeout=600)
    finally:
        run.interrupt()
        thread.join(timeout=60)
    return run, codes, kills

