"""The job's key Secret: not a child (its key material is made once and never rewritten),
created by the operator from render_keys_secret only when it is absent.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping

from distbelief.operator.render import podparts
from distbelief.operator.render.context import DEFAULT_IMAGE, RenderContext
from distbelief.operator.validation.job import DistBeliefJob

COMPONENT_KEYS = "keys"


def render_keys_secret(job: DistBeliefJob, files: Mapping[str, str]) -> podparts.Manifest:
    """The Secret ``<job>-keys`` holding ``files`` (distbelief.runtime.keys.JobKeys.files()).

    Immutable: the API server refuses any change to it, so keys are never rotated by a
    patch; rotating means deleting it and restarting the job's pods."""
    ctx = RenderContext.of(job, image=DEFAULT_IMAGE)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": podparts.metadata(ctx, ctx.names.keys_secret, COMPONENT_KEYS),
        "type": "Opaque",
        "immutable": True,
        "data": {name: base64.b64encode(text.encode("ascii")).decode("ascii")
                 for name, text in sorted(files.items())},
    }
