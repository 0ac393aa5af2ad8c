"""kubectl distbelief reads the kubeconfig as kubectl does: the file named, else $KUBECONFIG
(':'-joined files merged), the context named, else the current one, and its namespace."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from distbelief.operator import errors
from distbelief.operator.plugin.clusterjobs import connect


def kubeconfig(path: Path, *contexts: tuple[str, str, str | None], current: str | None = None) -> Path:
    """A kubeconfig of (context, server, namespace) triples, each with a cluster and user of its own."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": current or contexts[0][0],
        "clusters": [{"name": name, "cluster": {"server": server}} for name, server, _ in contexts],
        "users": [{"name": name, "user": {"token": f"token-{name}"}} for name, _, _ in contexts],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name,
                                               **({"namespace": ns} if ns else {})}} for name, _, ns in contexts]}))
    return path


def test_the_current_context_or_the_one_named_gives_the_server_token_and_namespace(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path / "config", ("lab", "https://lab.example:6443", "ml"),
                      ("prod", "https://prod.example:6443", None), current="lab")
    kube, namespace = connect(str(path), None)
    assert (kube.api.configuration.host, namespace) == ("https://lab.example:6443", "ml")
    assert kube.api.configuration.api_key["BearerToken"] == "Bearer token-lab"
    kube, namespace = connect(str(path), "prod")
    assert (kube.api.configuration.host, namespace) == ("https://prod.example:6443", "default")


def test_kubeconfig_files_joined_in_the_environment_are_merged(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    first = kubeconfig(tmp_path / "a", ("lab", "https://lab.example:6443", "ml"))
    second = kubeconfig(tmp_path / "b", ("prod", "https://prod.example:6443", "serving"))
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", f"{first}:{second}")
    assert connect(None, "prod")[1] == "serving"
    assert connect(None, None)[1] == "ml"


def test_a_missing_context_or_file_is_named(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path / "config", ("lab", "https://lab.example:6443", "ml"))
    with pytest.raises(errors.OperatorError, match="no context 'nope' in the kubeconfig"):
        connect(str(path), "nope")
    with pytest.raises(errors.OperatorError, match=f"kubeconfig {tmp_path / 'absent'}: "):
        connect(str(tmp_path / "absent"), None)
