"""Errors the runtime raises, in one tree.

    RuntimeFailure
    ├── ProtocolError        a message that breaks the wire protocol (bad header, size, op)
    │   ├── LayoutMismatch   a peer that partitions the model differently
    │   ├── WrongShard       a request addressed to another shard
    │   ├── NotServed        an op the shard's algorithm does not serve
    │   ├── Refused          well formed, but not applied (a non-finite gradient)
    │   ├── Forbidden        a privileged op from a peer without the chief's key
    │   ├── StateConflict    what the shard's state cannot take (a rollback it cannot do)
    │   ├── NotPrimary       a shard copy that does not serve clients now (a backup)
    │   └── BulkRejected     an encrypted job's bulk message not taken (unknown session,
    │                        replayed, forged, malformed): dropped, never answered
    ├── ShardUnavailable     a shard that did not answer in time
    ├── ShardRefused         a shard that answered with an error
    ├── ShardRestarted       a shard that lost the running Sandblaster iteration
    ├── JobFinished          a shard that answered that the job is done
    ├── GroupBroken          a partitioned replica's group that fell apart mid-step
    ├── LineSearchFailed     Sandblaster's line search found no decrease (lbfgs.py's own)
    ├── Stopped              the role was asked to stop while it waited
    ├── CheckpointError      a checkpoint that cannot be written
    │   ├── CorruptCheckpoint  a checkpoint that cannot be trusted on read
    │   └── ReshardError     checkpoints that cannot be re-cut for another shard count
    ├── ConfigError          a resolved config or data source the roles cannot use
    │   └── BadData          one file of a file source that cannot be used (names the file,
    │                        column and row group)
    └── Diverged             a replica whose training loss stayed non-finite

ZeroMQ's own errors are translated into these inside the transport (transport/); nothing above it
sees a zmq exception. A shard's ProtocolError travels back as an error reply whose code
(protocol.ErrorCode) names its kind. A config the roles cannot read becomes ConfigError
where it is loaded (model/job.py). Each name is taken once in the project; the operator's
own errors are distbelief.operator.errors. What the `distbelief` command prints and exits
with for each is decided in one place, its cli._report: ConfigError, LayoutMismatch and
CheckpointError exit 2 (contract.EXIT_INVALID_CONFIG), Diverged 3, any other 1.
"""

from __future__ import annotations


class RuntimeFailure(Exception):
    """Base of every error the runtime raises on purpose."""


class ProtocolError(RuntimeFailure):
    pass


class LayoutMismatch(ProtocolError):
    pass


class WrongShard(ProtocolError):
    pass


class NotServed(ProtocolError):
    pass


class Refused(ProtocolError):
    pass


class Forbidden(ProtocolError):
    pass


class StateConflict(ProtocolError):
    pass


class NotPrimary(ProtocolError):
    """This copy of a shard is a backup (or catching up): ask the shard's next copy."""


class BulkRejected(ProtocolError):
    """A bulk message that is not taken: unknown session, replayed, forged or malformed.
    The transport drops it (and logs it); nothing is answered."""


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


class ReshardError(CheckpointError):
    """Checkpoints that cannot be re-cut for another shard count (shard/reshard.py)."""


class ConfigError(RuntimeFailure):
    pass


class BadData(ConfigError):
    """A file of a file source that cannot be used; spec.data.onBadFile: skip skips it."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"spec.data.source: {where}: {problem}")
        self.where = where


class ShardRestarted(RuntimeFailure):
    """A shard lost the state of the running Sandblaster iteration (it restarted)."""


class JobFinished(RuntimeFailure):
    """A shard answered that the job is done."""


class Diverged(RuntimeFailure):
    """A replica's training loss stayed non-finite: the model diverged."""


class LineSearchFailed(RuntimeFailure):
    """Sandblaster's line search found no step that decreases the objective (caught in lbfgs.py)."""


class GroupBroken(RuntimeFailure):
    """A partitioned replica's group fell apart mid-step (a pod of it died or left); its
    step is not applied, and its pods join new groups."""
