"""The example jobs, validated as a user's would be, and a spec.model as the runtime takes it."""

from __future__ import annotations

from typing import Any

from distbelief.operator.validation import spec
from distbelief.runtime import jobresolve, jobspec
from support.paths import EXAMPLES


def load_example(name: str) -> dict[str, Any]:
    (doc,) = spec.load_manifests(str(EXAMPLES / name))
    return doc


def typed_model(written: dict[str, Any]) -> jobspec.Model:
    """A spec.model as the runtime takes it, resolved from a dict as a job's config is."""
    return jobresolve.resolve({"data": {"source": "builtin:digits"}, "model": written}).model
