"""Errors the runtime raises, in one tree.

    RuntimeFailure
    ├── ProtocolError        a message that breaks the wire protocol (bad header, size, op)
    │   └── LayoutMismatch   a peer that partitions the model differently
    ├── ShardUnavailable     a shard that did not answer in time
    ├── ShardRefused         a shard that answered with an error
    ├── Stopped              the role was asked to stop while it waited
    ├── CheckpointError      a checkpoint that cannot be written
    │   └── CorruptCheckpoint  a checkpoint that cannot be trusted on read
    └── ConfigError          a resolved config or data source the roles cannot use

ZeroMQ's own errors are translated into these inside the transport (client.py and
shard.py); nothing above them sees a zmq exception.
"""

from __future__ import annotations


class RuntimeFailure(Exception):
    """Base of every error the runtime raises on purpose."""


class ProtocolError(RuntimeFailure):
    pass


class LayoutMismatch(ProtocolError):
    pass


class ShardUnavailable(RuntimeFailure):
    pass


class ShardRefused(RuntimeFailure):
    pass


class Stopped(RuntimeFailure):
    pass


class CheckpointError(RuntimeFailure):
    pass


class CorruptCheckpoint(CheckpointError):
    pass


class ConfigError(RuntimeFailure):
    pass


class ShardRestarted(RuntimeFailure):
    """A shard lost the state of the running Sandblaster iteration (it restarted)."""


class JobFinished(RuntimeFailure):
    """A shard answered that the job is done."""
