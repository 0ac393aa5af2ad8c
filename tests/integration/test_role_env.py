"""The role environment's allocator settings do what contract.ROLE_ENV says: a large
buffer freed and allocated again reuses pages already in place instead of taking fresh
zeroed pages from the kernel, as every large ZeroMQ frame and AES-GCM output would."""

from __future__ import annotations

import os
import subprocess
import sys

from distbelief.runtime import contract

# Allocates, frees and allocates again 64 MiB (over glibc's largest mmap threshold, as
# a large model's slice is) and prints the page faults the second allocation took.
REALLOCATE = """
import resource
import numpy as np
size = 64 << 20
np.ones(size // 4, dtype=np.float32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
np.ones(size // 4, dtype=np.float32)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_of_a_reallocation(extra_env: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | extra_env
    out = subprocess.run([sys.executable, "-c", REALLOCATE], env=env, check=True,
                         capture_output=True, text=True, timeout=60)
    return int(out.stdout)


def test_a_large_buffer_allocated_again_reuses_its_pages_under_the_role_environment():
    fresh = faults_of_a_reallocation({})
    reused = faults_of_a_reallocation(contract.ROLE_ENV)
    assert fresh > 256, f"without the settings a reallocation should fault its pages in ({fresh})"
    assert reused < fresh / 10, f"{reused} page faults under {contract.ROLE_ENV} against {fresh} without"
