"""Rank 0's per-step medians at the simulator's scale give np.median's values to the bit.

``DecisionCore.relative`` takes the job's median compute and ``_pool_noise`` the cross-rank
spread (1.4826 MAD of log relative compute) every step over every rank; both select in place
(``decision._select_median``) instead of calling np.median. A different last bit would move
a ratio or a noise floor, and with it a decision, so the values are compared exactly: on
random arrays of both parities, with ties at the middle, and through ``_pool_noise`` itself
against the formula it replaced."""

from __future__ import annotations

import numpy as np

from stalwart.detect import decision
from stalwart.detect.decision import DecisionCore, _select_median


def _arrays(rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for n in (1, 2, 3, 5, 64, 65, 1000, 1001, 10000):
        out.append(0.1 * np.exp(rng.normal(0.0, 0.3, n)))
        out.append(rng.standard_t(2, n))  # heavy tails, negative values
        # many equal values at the middle (+ 0.0: no -0.0, which _select_median excludes)
        tied = np.round(rng.normal(0.0, 1.0, n), 1) + 0.0
        out.append(tied)
    return out


def test_select_median_is_np_median_to_the_bit() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        for a in _arrays(rng):
            want = float(np.median(a))
            got = _select_median(a.copy())
            assert got == want and np.signbit(got) == np.signbit(want), (a.size, got, want)


def test_pool_noise_spread_is_the_np_median_formula() -> None:
    rng = np.random.default_rng(1)
    for n in (5, 63, 64, 1000, 10000):
        core = DecisionCore(True)
        group = core._rel_dets(n)
        for _ in range(6):
            comps = 0.1 * np.exp(rng.standard_t(3, n) * 0.05)
            rel = comps / float(np.median(comps))
            x = np.log(rel)
            want = float(1.4826 * np.median(np.abs(x - np.median(x))))
            kept = rel.copy()
            core._pool_noise(group.detectors, rel if n >= decision.VECTOR_RANKS
                             else rel.tolist())
            assert core._spreads[-1] == want
            assert np.array_equal(rel, kept)  # the caller's ratios are not reordered
