"""pytest fixtures of the cluster tier: one real control plane per session, a namespace per test.

    control_plane   the started ControlPlane (session-scoped), its CRD and chart not installed
    kubectl         run kubectl against it: kubectl("get", "pods", "-n", ns) -> stdout
    namespace       a fresh namespace for one test, deleted after it

Without the binaries, kubectl or helm the tests that use these skip with one line saying
how to get them; under CI=true they fail instead, so CI never passes by skipping them.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from support import controlplane


class Kubectl:
    def __init__(self, plane: controlplane.ControlPlane, binary: str) -> None:
        self.plane, self.binary = plane, binary

    def __call__(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        done = self.run(*args, input=input, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def run(self, *args: str, input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.binary, *args], input=input, capture_output=True, text=True,
                              env=self.plane.env(), timeout=timeout)

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json"))


def unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the cluster tests must run under CI=true: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    folder = controlplane.binaries()
    if folder is None:
        unavailable(f"no Kubernetes control plane here: {controlplane.HOW}")
    plane = controlplane.ControlPlane(folder, tmp_path_factory.mktemp("control-plane")).start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kubectl(control_plane: controlplane.ControlPlane) -> Kubectl:
    binary = controlplane.tool("kubectl")
    if binary is None:
        unavailable("no kubectl: `make kube-tools` fetches it")
    return Kubectl(control_plane, binary)


@pytest.fixture(scope="session")
def helm(control_plane: controlplane.ControlPlane) -> Callable[..., str]:
    binary = controlplane.tool("helm")
    if binary is None:
        unavailable("no helm: `make kube-tools` fetches it")

    def run(*args: str, timeout: float = 120) -> str:
        done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout,
                              env=control_plane.env(HELM_CACHE_HOME=str(control_plane.dir / "helm"),
                                                    HELM_CONFIG_HOME=str(control_plane.dir / "helm"),
                                                    HELM_DATA_HOME=str(control_plane.dir / "helm")))
        if done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()}")
        return done.stdout

    return run


@pytest.fixture
def namespace(kubectl: Kubectl) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", check=False)
