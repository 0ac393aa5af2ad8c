"""The layout hash in another Python process: every role derives it on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from distbelief.runtime.wire.layout import Layout

SHAPES = [("layer0.weight", (64, 32)), ("layer0.bias", (32,)), ("layer1.weight", (32, 10)), ("layer1.bias", (10,))]


def test_hash_is_the_same_in_another_process():
    """Every role derives it on its own: it must not depend on per-process state such as
    Python's randomised str hashing."""
    code = ("import json, sys; from distbelief.runtime.wire.layout import Layout; "
            "print(Layout.of([tuple(s) for s in json.loads(sys.argv[1])], 3).hash)")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(SHAPES)], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert int(out) == Layout.of(SHAPES, 3).hash
