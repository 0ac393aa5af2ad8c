"""pytest fixture ``kube``: a started KubeEmulator serving this project's CRD.

List it in tests/conftest.py with ``pytest_plugins = ["kube.plugin"]``, or import the
fixture into one test module: ``from kube.plugin import kube  # noqa: F401``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .emulator import KubeEmulator

REPO = Path(__file__).resolve().parents[2]
JOB_CRD = REPO / "crds" / "distbelief.io_distbeliefjobs.yaml"
JOB_RESOURCE = "distbelief.io/v1alpha1/distbeliefjobs"


def project_emulator(**kwargs: object) -> KubeEmulator:
    """An emulator (not started) that serves DistBeliefJobs as the CRD in crds/ defines them:
    defaulted and validated by the project's own validator, ``spec.validate_job``."""
    from distbelief.operator.spec import spec

    return KubeEmulator(crds=[JOB_CRD], validators={JOB_RESOURCE: spec.validate_job}, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubeEmulator]:
    """The emulator, started, with its kubeconfig written to ``tmp_path/kubeconfig``
    (``kube.kubeconfig``; ``kube.env()`` for subprocesses)."""
    emulator = project_emulator().start()
    emulator.write_kubeconfig(tmp_path / "kubeconfig")
    try:
        yield emulator
    finally:
        emulator.stop()
