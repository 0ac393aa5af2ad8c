"""The node agent's command line for a container: mount paths rewritten in the container's
own words, never in the interpreter that stands for the image's entry point."""

from __future__ import annotations

import sys

import pytest

from localnode import containers

MOUNTS = {"/tmp": "/var/lib/node/pods/p1/volumes/tmp", "/data": "/var/lib/node/pods/p1/volumes/data"}


def _local(word: str) -> str:
    return containers.localizer(MOUNTS, "/var/lib/node/pods/p1/termination/ps", containers.TERMINATION_LOG)(word)


@pytest.mark.parametrize("interpreter", ["/tmp/clone/.venv/bin/python3", "/data/venv/bin/python"])
def test_an_interpreter_under_a_mount_path_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch, interpreter: str) -> None:
    monkeypatch.setattr(sys, "executable", interpreter)
    container = {"name": "ps", "image": "distbelief/distbelief:0.1.0", "args": ["shard", "--output", "/data/ckpt"]}

    argv = containers.argv(container, {}, _local)

    assert argv[:3] == [interpreter, "-m", "distbelief.operator.cli"]
    assert argv[3:] == ["shard", "--output", "/var/lib/node/pods/p1/volumes/data/ckpt"]


def test_a_command_under_a_mount_path_is_made_local(monkeypatch: pytest.MonkeyPatch) -> None:
    container = {"name": "w", "command": ["/data/bin/train", "$(OUT)/x"], "args": ["/tmp/scratch"]}

    argv = containers.argv(container, {"OUT": "/data/out"}, _local)

    assert argv == ["/var/lib/node/pods/p1/volumes/data/bin/train", "/var/lib/node/pods/p1/volumes/data/out/x",
                    "/var/lib/node/pods/p1/volumes/tmp/scratch"]
