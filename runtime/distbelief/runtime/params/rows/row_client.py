"""The replica's side of the sparse rows (sparse.py): pulls and pushes rows by key.

Each key goes to the shard that owns it (rowkeys.owner_of), all shards in one request at
once (ShardGroup.request with one payload and one array per shard), in chunks of at most
keys_per_request(dim) keys per shard.
"""

from __future__ import annotations

import numpy as np

from distbelief.runtime.client.group import Reply, ShardGroup
from distbelief.runtime.params.rows.sparse import SPARSE_PULL, SPARSE_PUSH, KeyCounts, Keys, keys_per_request
from distbelief.runtime.wire.rowkeys import owner_of


class RowClient:
    """Pulls and pushes rows of unique keys, each key to its owner, all shards at once."""

    def __init__(self, group: ShardGroup, dim: int) -> None:
        self.group, self.dim = group, dim

    def _split(self, keys: np.ndarray) -> tuple[np.ndarray, list[slice]]:
        """The keys grouped by owner (order), and each shard's span of that order."""
        owners = owner_of(keys, self.group.layout.shards)
        order = np.argsort(owners, kind="stable")
        ends = np.cumsum(np.bincount(owners, minlength=self.group.layout.shards))
        return order, [slice(int(a), int(b)) for a, b in zip(np.r_[0, ends[:-1]], ends)]

    def pull(self, keys: np.ndarray) -> tuple[np.ndarray, list[Reply]]:
        """The rows of keys ([n, dim], in the keys' order) and the last shards' replies."""
        rows = np.empty((keys.size, self.dim), dtype=np.float32)
        replies: list[Reply] = []
        for chunk in self._chunks(keys.size):  # no shard gets more than MAX_KEYS keys in one request
            rows[chunk], replies = self._pull(keys[chunk])
        return rows, replies

    def _pull(self, keys: np.ndarray) -> tuple[np.ndarray, list[Reply]]:
        order, spans = self._split(keys)
        metas = [Keys(keys[order[span]]) for span in spans]
        # Zeros: a shard that answers DONE sends no rows, and the step still computes on finite ones.
        grouped = np.zeros((keys.size, self.dim), dtype=np.float32)
        replies = self.group.request(SPARSE_PULL, meta=metas, receive_into=[grouped[s].reshape(-1) for s in spans])
        rows = np.empty_like(grouped)
        rows[order] = grouped
        return rows, replies

    def push(self, keys: np.ndarray, grads: np.ndarray, occurrences: np.ndarray | None = None) -> list[Reply]:
        """Push each key's row gradient (grads [n, dim], in the keys' order) to its owner, with
        how many times the key occurred in the examples behind it (what admission counts;
        None: once each)."""
        if occurrences is None:
            occurrences = np.ones(keys.size, dtype=np.int64)
        replies: list[Reply] = []
        for chunk in self._chunks(keys.size):
            order, spans = self._split(keys[chunk])
            keys_, counts = keys[chunk][order], occurrences[chunk][order]
            metas = [KeyCounts(keys_[span], counts[span]) for span in spans]
            grouped = np.ascontiguousarray(grads[chunk][order], dtype=np.float32)
            replies = self.group.request(SPARSE_PUSH, meta=metas, array=[grouped[s].reshape(-1) for s in spans])
        return replies

    def _chunks(self, n: int) -> list[slice]:
        step = keys_per_request(self.dim)
        return [slice(start, start + step) for start in range(0, n, step)]
