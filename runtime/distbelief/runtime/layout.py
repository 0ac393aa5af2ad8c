"""How a model's flat parameter vector is split over the shards.

Every role derives the same partition from the model's parameter shapes and the shard
count alone, so they agree without talking; the layout hash, sent on every request,
catches a peer that derived it from something else.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Layout:
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    shards: int

    @classmethod
    def of(cls, shapes: Sequence[tuple[str, Sequence[int]]], shards: int) -> "Layout":
        if shards < 1:
            raise ValueError("a layout needs at least one shard")
        frozen = tuple((name, tuple(int(d) for d in shape)) for name, shape in shapes)
        layout = cls(shapes=frozen, shards=shards)
        if layout.total < shards:
            raise ValueError(f"{layout.total} parameters cannot be split over {shards} shards")
        return layout

    @functools.cached_property  # asked on every request: shapes never change
    def total(self) -> int:
        count = 0
        for _, shape in self.shapes:
            size = 1
            for d in shape:
                size *= d
            count += size
        return count

    def bounds(self, shard: int) -> tuple[int, int]:
        """The [start, stop) range of the flat vector that a shard owns; sizes differ by <= 1."""
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} is outside 0..{self.shards - 1}")
        return (shard * self.total // self.shards, (shard + 1) * self.total // self.shards)

    def size(self, shard: int) -> int:
        start, stop = self.bounds(shard)
        return stop - start

    @functools.cached_property
    def hash(self) -> int:
        """A 64-bit fingerprint of the shapes, their order, the dtype and the shard count."""
        text = json.dumps({"dtype": "float32", "shards": self.shards,
                           "shapes": [[n, list(s)] for n, s in self.shapes]})
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
