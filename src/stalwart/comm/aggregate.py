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
    """Sum and per-chunk contributor count of one shard for one round.

    ``sum`` holds the sum of the *other* ranks' contributions and ``count`` how many arrived,
    per chunk; where ``count`` is 0 the chunk's ``sum`` is not read (it holds an earlier
    round's values): the first contribution to a chunk is copied in, the next ones added.
    So ``reset`` touches only the counts and flags, never the shard-sized sum (a 4 MiB pass
    per round for a 16 MiB vector at 4 ranks). The owner's own contribution is not added as
    it is given (``add_own`` keeps a reference) but in ``average``'s single pass. The native
    engine (``_native/engine.c``: ``sum_into``, ``Engine.average``) follows the same rules on
    the same arrays, with the same float32 operations in the same order per element.
    """

    def __init__(self, layout: Layout, owner: int, keep: bool = False) -> None:
        self.layout = layout
        self.owner = owner
        self.chunk = layout.chunk
        n = layout.shard_len(owner)
        self.sum = np.zeros(n, np.float32)
        nc = layout.n_chunks(owner)
        self.count = np.zeros(nc, np.int32)
        self.seen = np.zeros((layout.world, nc), bool)
        self.own: np.ndarray | None = None
        # keep: every sender's contribution as it arrived (for the erasure decoder, which
        # rebuilds a lost chunk from the others of its stripe); chunk-aligned, the tail of
        # the last chunk stays zero (never written), as the sender's padding is
        self.contrib = np.zeros((layout.world, nc * self.chunk), np.float32) if keep else None

    def reset(self) -> None:
        """A new round: no contribution counted (O(chunks x world), the sum is not cleared)."""
        self.count[:] = 0
        self.seen[:] = False
        self.own = None

    def add_own(self, values: np.ndarray) -> None:
        """The owner's contribution: kept by reference (not copied) until ``average``, which
        reads it -- ``values`` must not change in between."""
        self.own = values
        self.seen[self.owner] = True

    def add(self, sender: int, offset: int, payload: np.ndarray) -> bool:
        """Add one chunk from ``sender``; False (nothing written) if it was already counted."""
        c = offset // self.chunk
        if self.seen[sender, c]:
            return False
        self.seen[sender, c] = True
        if self.count[c] == 0:
            self.sum[offset: offset + payload.size] = payload
        else:
            self.sum[offset: offset + payload.size] += payload
        if self.contrib is not None:
            self.contrib[sender, offset: offset + payload.size] = payload
        self.count[c] += 1
        return True

    def add_chunks(self, chunks: np.ndarray, payloads: np.ndarray) -> None:
        """Add whole chunks (``payloads[i]`` of length ``chunk`` is chunk ``chunks[i]``; the
        chunks distinct, not counted yet for their sender -- the caller marks ``seen``)."""
        C = self.chunk
        nfull = self.sum.size // C
        v = self.sum[: nfull * C].reshape(nfull, C)
        first = self.count[chunks] == 0
        if first.all():
            v[chunks] = payloads
        else:
            v[chunks[first]] = payloads[first]
            v[chunks[~first]] += payloads[~first]
        self.count[chunks] += 1

    def received(self) -> int:
        """Chunks received from others (the owner's own are not packets)."""
        return int(self.seen.sum() - self.seen[self.owner].sum())

    def _total(self) -> np.ndarray:
        """Per element: the sum of the contributions that arrived, the owner's last."""
        own = self.own if self.own is not None else np.zeros(self.sum.size, np.float32)
        if self.count.size and (self.count == self.count[0]).all():  # every chunk alike
            return self.sum + own if self.count[0] else own.copy()
        tot = own.copy()
        np.add(self.sum, own, out=tot, where=self.layout.expand(self.owner, self.count > 0))
        return tot

    def average(self, out: np.ndarray | None = None) -> np.ndarray:
        """The unbiased estimate: per chunk, the mean over the contributions that arrived --
        ``(sum + own) / (count + 1)`` in float32, the owner's own values where nothing else
        arrived. ``out`` may be the owner's own values (element-wise in place)."""
        own = self.own if self.own is not None else np.zeros(self.sum.size, np.float32)
        has_own = self.own is not None
        if self.count.size and (self.count == self.count[0]).all():  # every chunk alike
            k = int(self.count[0])
            if k == 0:
                return np.divide(own, np.float32(1), out=out) if has_own else np.zeros_like(own)
            tot = np.add(self.sum, own, out=out)
            return np.divide(tot, np.float32(k + has_own), out=tot)
        div = self.layout.expand(self.owner, np.maximum(self.count + has_own, 1))
        return np.divide(self._total(), div.astype(np.float32), out=out)

    def zero_filled(self) -> np.ndarray:
        """The biased alternative (missing contributions counted as zeros)."""
        return self._total() / np.float32(self.layout.world)
