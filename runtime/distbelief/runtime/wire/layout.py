"""How a model's flat parameter vector is split over the shards.

Every role derives the same partition from the model's parameter shapes and the shard
count alone, so they agree without talking; the layout hash, sent on every request,
catches a peer that derived it from something else.

A partitioned model (spec.model.partitions > 1) gives the layout its stage boundaries:
each stage then gets shards of its own, as many as its share of the parameters allows
(at least one), so a partition pulls and pushes only to the shards of its stage.
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
    stages: tuple[int, ...] = ()   # where each stage after the first begins in the flat vector

    @classmethod
    def of(cls, shapes: Sequence[tuple[str, Sequence[int]]], shards: int,
           stages: Sequence[int] = ()) -> "Layout":
        if shards < 1:
            raise ValueError("a layout needs at least one shard")
        frozen = tuple((name, tuple(int(d) for d in shape)) for name, shape in shapes)
        layout = cls(shapes=frozen, shards=shards, stages=tuple(int(b) for b in stages))
        if layout.total < shards:
            raise ValueError(f"{layout.total} parameters cannot be split over {shards} shards")
        if len(layout.stages) + 1 > shards:
            raise ValueError(f"spec.parameterServers.shards must be at least spec.model.partitions: "
                             f"{len(layout.stages) + 1} stages need a shard each, the job has {shards}")
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
        """The [start, stop) range of the flat vector that a shard owns; sizes differ by <= 1
        (within a stage, when the model is partitioned)."""
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} is outside 0..{self.shards - 1}")
        return self._cuts[shard], self._cuts[shard + 1]

    def shards_of(self, start: int, stop: int) -> list[int]:
        """The shards holding some of the flat range [start, stop)."""
        return [i for i in range(self.shards) if self._cuts[i] < stop and self._cuts[i + 1] > start]

    @functools.cached_property
    def _cuts(self) -> tuple[int, ...]:
        """Every shard's start, and the end: an even split of each stage over its shards."""
        edges = [0, *self.stages, self.total]
        spans = [b - a for a, b in zip(edges, edges[1:])]
        cuts: list[int] = []
        for (start, span), count in zip(zip(edges, spans), _apportion(spans, self.shards)):
            cuts += [start + i * span // count for i in range(count)]
        return (*cuts, self.total)

    def size(self, shard: int) -> int:
        start, stop = self.bounds(shard)
        return stop - start

    @functools.cached_property
    def hash(self) -> int:
        """A 64-bit fingerprint of the shapes, their order, the dtype and the shard count."""
        fields: dict = {"dtype": "float32", "shards": self.shards, "shapes": [[n, list(s)] for n, s in self.shapes]}
        if self.stages:
            fields["stages"] = list(self.stages)
        text = json.dumps(fields)
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _apportion(spans: Sequence[int], shards: int) -> list[int]:
    """Shards per stage: one each, then each next one to the stage whose shards hold the
    most parameters apiece (the earliest on a tie)."""
    counts = [1] * len(spans)
    for _ in range(shards - len(spans)):
        heaviest = max(range(len(spans)), key=lambda i: (spans[i] / counts[i], -i))
        counts[heaviest] += 1
    return counts
