"""Errors the operator raises, in one tree.

    OperatorError
    ├── SpecError      a manifest the user wrote is wrong; `errors` holds one line per
    │                  problem (also a ValueError, as a validation failure)
    ├── KubeError      a call to the Kubernetes API failed; `status` is its HTTP status
    ├── ScrapeError    a pod's metrics endpoint gave no 200 answer within the size and
    │                  time bounds
    ├── VolumeError    tools/local-node: a pod's volume that cannot be made yet (its
    │                  ConfigMap, Secret or claim is missing or unbound)
    └── ContainerConfigError  tools/local-node: a container that cannot be made (what a
                       kubelet reports as CreateContainerConfigError)

Low-level errors are translated where they arise, once: the Kubernetes client's
ApiException into KubeError in cluster/kube.py, a YAML parser's error into SpecError in
validation/manifests.py, a socket's timeout into ScrapeError in status/scrape.py. The runtime's
errors (distbelief.runtime.errors, RuntimeFailure and below) are a tree of their own;
the `distbelief` command turns both into one line and an exit code in one place,
cli._report: SpecError exits 2 (contract.EXIT_INVALID_CONFIG), any other OperatorError 1.

The bottom of the operator: this module imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable


class OperatorError(Exception):
    """Base of every error the operator raises on purpose."""


class SpecError(OperatorError, ValueError):
    """A manifest the user wrote is wrong; ``errors`` holds one line per problem."""

    def __init__(self, errors: Iterable[str] | str) -> None:
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(self.errors)


class KubeError(OperatorError):
    """A Kubernetes API call that failed: the verb, the object, the status and the reason."""

    def __init__(self, verb: str, what: str, status: int | None, reason: str | None) -> None:
        self.status = status
        super().__init__(f"{verb} {what}: {status} {reason}")


class ScrapeError(OperatorError):
    """The endpoint did not give a 200 answer within the size and time bounds."""


class VolumeError(OperatorError):
    """A volume that cannot be made yet (its ConfigMap, Secret or claim is missing or unbound)."""


class ContainerConfigError(OperatorError):
    """What a kubelet reports as CreateContainerConfigError: the container cannot be made."""
