"""Unbiased aggregation: over many random loss patterns the owner's estimate averages to the
true mean gradient; zero-filling does not. Plus the shard/chunk layout for any world size."""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
import pytest

from stalwart.comm.aggregate import ShardAccumulator
from stalwart.comm.layout import Layout

ALPHA = 1e-6  # family-wise chance that a correct implementation fails this test


def z_crit(n_tests: int) -> float:
    """Two-sided Bonferroni bound: P(any |z| > crit | unbiased) <= ALPHA."""
    return NormalDist().inv_cdf(1 - ALPHA / (2 * n_tests))


def simulate(world: int, owner: int, p: float, trials: int, seed: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per trial: every rank draws an unbiased stochastic gradient G + noise; each non-owner
    chunk packet is lost with probability p (independently of the values); the real
    ShardAccumulator aggregates what arrived. Returns (G's shard, estimates, zero-filled)."""
    lay = Layout(numel=23, world=world, chunk=3)  # 23 is divisible by neither 3 nor 5
    rng = np.random.default_rng(seed)
    G = np.linspace(-2.0, 3.0, lay.numel).astype(np.float32)
    lo, hi = lay.shard(owner)
    offs = lay.chunk_offsets(owner)
    lens = lay.chunk_lengths(owner)
    est = np.empty((trials, hi - lo))
    zf = np.empty((trials, hi - lo))
    acc = ShardAccumulator(lay, owner)
    for t in range(trials):
        acc.reset()
        g = G[None, :] + rng.standard_normal((world, lay.numel)).astype(np.float32)
        acc.add_own(g[owner, lo:hi])
        arrive = rng.random((world, len(offs))) >= p
        for s in range(world):
            if s == owner:
                continue
            for c, (o, n) in enumerate(zip(offs, lens, strict=True)):
                if arrive[s, c]:
                    assert acc.add(s, int(o), g[s, lo + o: lo + o + n])
        est[t] = acc.average()
        zf[t] = acc.zero_filled()
    return G[lo:hi].astype(np.float64), est, zf


def zscores(samples: np.ndarray, expected: np.ndarray) -> np.ndarray:
    se = samples.std(axis=0, ddof=1) / np.sqrt(len(samples))
    return (samples.mean(axis=0) - expected) / se


@pytest.mark.parametrize("world,owner,p", [(3, 0, 0.3), (3, 2, 0.1), (5, 1, 0.3), (5, 4, 0.5)])
def test_owner_average_is_unbiased_and_zero_fill_is_not(world: int, owner: int, p: float) -> None:
    trials = 3000
    G, est, zf = simulate(world, owner, p, trials, seed=world * 100 + owner)
    crit = z_crit(G.size)
    # unbiased: the mean of the estimates matches the true gradient at every element
    assert np.abs(zscores(est, G)).max() < crit
    # zero-filling: mean is G * E|R| / world (E|R| = 1 + (world-1)(1-p)), detectably off
    shrink = (1 + (world - 1) * (1 - p)) / world
    assert np.abs(zscores(zf, G * shrink)).max() < crit  # the theory of its bias holds ...
    nonzero = np.abs(G) > 0.5
    assert (np.abs(zscores(zf, G))[nonzero] > crit).all()  # ... and it is biased


def test_duplicates_are_refused_and_never_double_counted() -> None:
    lay = Layout(numel=10, world=3, chunk=4)
    acc = ShardAccumulator(lay, 0)
    acc.add_own(np.zeros(4, np.float32))
    assert acc.add(1, 0, np.full(4, 3.0, np.float32))
    assert not acc.add(1, 0, np.full(4, 100.0, np.float32))  # a replay within the round
    np.testing.assert_allclose(acc.average(), np.full(4, 1.5))
    assert acc.received() == 1


def test_missing_contributions_never_divide_by_zero() -> None:
    lay = Layout(numel=7, world=2, chunk=2)
    acc = ShardAccumulator(lay, 1)
    acc.add_own(np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(acc.average(), np.arange(3))  # only the owner's own


@pytest.mark.parametrize("numel,world,chunk", [(23, 3, 3), (23, 5, 4), (4, 5, 2), (0, 3, 1),
                                               (10**6 + 1, 5, 358)])
def test_layout_partitions_any_size(numel: int, world: int, chunk: int) -> None:
    lay = Layout(numel, world, chunk)
    b = lay.bounds
    assert b[0] == 0 and b[-1] == numel and all(x <= y for x, y in zip(b, b[1:], strict=False))
    lens = lay.shard_lens
    assert max(lens) - min(lens) <= 1
    for r in range(world):
        offs, ln = lay.chunk_offsets(r), lay.chunk_lengths(r)
        assert ln.sum() == lens[r] and (ln <= chunk).all() and (ln > 0).all()
        assert (offs % chunk == 0).all()
