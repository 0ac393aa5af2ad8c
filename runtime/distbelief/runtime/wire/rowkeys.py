"""Row keys: the ids of embedding rows, their hash, and which shard owns each.

A key is a non-negative 63-bit integer (an id of the data's id fields, or its hash bucket).
mix() is splitmix64's finaliser over an array, a well-spread 64-bit hash of each value;
owner_of() takes the high half of it modulo the shard count: the one function that
partitions keys, on replicas and shards alike, as the Layout partitions the dense vector.
The row tables' slots use the low half (params/rows/rowtable.py).
"""

from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix(keys: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over an array: a well-spread 64-bit hash of each value."""
    z = keys.astype(np.uint64, copy=True)
    z += GOLDEN
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def owner_of(keys: np.ndarray, shards: int) -> np.ndarray:
    """The shard that owns each key. The high half of the hash: the table's slots use the low."""
    return ((mix(keys) >> np.uint64(32)) % np.uint64(shards)).astype(np.int64)
