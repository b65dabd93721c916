"""Unbiased per-chunk aggregation at a shard's owner.

Mechanism: phase 1 of "Distributed Training under Packet Loss" (and RPS, ICML '19). For each
chunk the owner averages the contributions that arrived, its own always included:
``g_hat = (1/|R|) * sum_{i in R} g_i``. Packet drops are independent of the values and every
g_i is an unbiased stochastic gradient of the true gradient G, so ``E[g_hat | R] = G`` for every
arrival set R and hence ``E[g_hat] = G``: the aggregate is unbiased whatever the loss rate.
Zero-filling (sum of arrived / world size) is biased: its mean is ``G * E|R| / world``, shrunk
by about the loss rate -- ``zero_filled()`` exists so tests can show that.

Guarantees: a duplicate (same sender, same chunk) is refused, so a replayed packet can never be
counted twice; every chunk's divisor is >= 1 (the owner's own contribution).
"""

from __future__ import annotations

import numpy as np

from stalwart.comm.layout import Layout


class ShardAccumulator:
    """Sum and per-chunk contributor count of one shard for one round."""

    def __init__(self, layout: Layout, owner: int, keep: bool = False) -> None:
        self.layout = layout
        self.owner = owner
        self.chunk = layout.chunk
        n = layout.shard_len(owner)
        self.sum = np.zeros(n, np.float32)
        nc = layout.n_chunks(owner)
        self.count = np.zeros(nc, np.int32)
        self.seen = np.zeros((layout.world, nc), bool)
        # keep: every sender's contribution as it arrived (for the erasure decoder, which
        # rebuilds a lost chunk from the others of its stripe); chunk-aligned, the tail of
        # the last chunk stays zero (never written), as the sender's padding is
        self.contrib = np.zeros((layout.world, nc * self.chunk), np.float32) if keep else None

    def reset(self) -> None:
        self.sum[:] = 0
        self.count[:] = 0
        self.seen[:] = False

    def add_own(self, values: np.ndarray) -> None:
        self.sum += values
        self.count += 1
        self.seen[self.owner] = True

    def add(self, sender: int, offset: int, payload: np.ndarray) -> bool:
        """Add one chunk from ``sender``; False (nothing written) if it was already counted."""
        c = offset // self.chunk
        if self.seen[sender, c]:
            return False
        self.seen[sender, c] = True
        self.sum[offset: offset + payload.size] += payload
        if self.contrib is not None:
            self.contrib[sender, offset: offset + payload.size] = payload
        self.count[c] += 1
        return True

    def received(self) -> int:
        """Chunks received from others (the owner's own are not packets)."""
        return int(self.seen.sum() - self.seen[self.owner].sum())

    def average(self, out: np.ndarray | None = None) -> np.ndarray:
        """The unbiased estimate: per chunk, the mean over the contributions that arrived."""
        if self.count.size and (self.count == self.count[0]).all():  # every chunk alike
            return np.divide(self.sum, np.float32(max(int(self.count[0]), 1)), out=out)
        div = self.layout.expand(self.owner, np.maximum(self.count, 1)).astype(np.float32)
        return np.divide(self.sum, div, out=out)

    def zero_filled(self) -> np.ndarray:
        """The biased alternative (missing contributions counted as zeros)."""
        return self.sum / np.float32(self.layout.world)
