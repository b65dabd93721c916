"""How a flat parameter/gradient vector is cut into shards (one per rank) and packets (chunks).

Mechanism: the reduce-scatter partition of "Distributed Training under Packet Loss" and of ZeRO-1
-- rank r owns one contiguous shard and keeps its optimizer state. Shards differ in size by at
most one element (like ``numpy.array_split``), so any world size works, including ones that do
not divide the parameter count (3, 5); a shard may be empty when there are fewer elements than
ranks. Each shard is cut into chunks of ``chunk`` floats (the last one shorter): one chunk, one
packet, so a lost packet loses exactly one chunk of one sender.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Layout:
    numel: int
    world: int
    chunk: int

    def __post_init__(self) -> None:
        if self.numel < 0 or self.world < 1 or self.chunk < 1:
            raise ValueError(f"bad layout numel={self.numel} world={self.world} chunk={self.chunk}")

    @cached_property
    def bounds(self) -> list[int]:
        base, extra = divmod(self.numel, self.world)
        b = [0]
        for r in range(self.world):
            b.append(b[-1] + base + (1 if r < extra else 0))
        return b

    def shard(self, r: int) -> tuple[int, int]:
        b = self.bounds
        return b[r], b[r + 1]

    def shard_len(self, r: int) -> int:
        lo, hi = self.shard(r)
        return hi - lo

    @property
    def shard_lens(self) -> list[int]:
        return [self.shard_len(r) for r in range(self.world)]

    def n_chunks(self, r: int) -> int:
        return -(-self.shard_len(r) // self.chunk)

    def chunk_offsets(self, r: int) -> np.ndarray:
        """Offsets (inside shard r) of its chunks."""
        return np.arange(0, self.shard_len(r), self.chunk, dtype=np.int64)

    def chunk_lengths(self, r: int) -> np.ndarray:
        offs = self.chunk_offsets(r)
        return np.minimum(self.chunk, self.shard_len(r) - offs)

    def expand(self, r: int, per_chunk: np.ndarray) -> np.ndarray:
        """A per-chunk array of shard r repeated to one value per element."""
        return np.repeat(per_chunk, self.chunk_lengths(r))
