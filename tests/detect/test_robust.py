"""robust.rank_sum_z against scipy's rank-sum statistic (average ranks for ties)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import rankdata

from stalwart.detect.robust import median, rank_sum_z


def _scipy_z(before: np.ndarray, after: np.ndarray) -> float:
    n1, n2 = len(before), len(after)
    ranks = rankdata(np.concatenate([before, after]))
    u = float(ranks[n1:].sum()) - n2 * (n2 + 1) / 2.0
    return (u - n1 * n2 / 2.0) / math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12.0)


# step times on a coarse grid, so that ties (which average ranks must split) are common
_times = st.lists(st.integers(0, 12).map(lambda k: 0.01 * k), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(_times, _times)
def test_rank_sum_z_is_scipys_statistic_exactly(before: list[float], after: list[float]) -> None:
    b, a = np.array(before), np.array(after)
    assert rank_sum_z(b, a) == _scipy_z(b, a)


def test_a_detector_rank_does_not_import_scipy() -> None:
    import subprocess
    import sys

    code = ("import sys, stalwart.detect, stalwart.train.worker; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'scipy'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_median_is_numpys_median_exactly() -> None:
    """``robust.median`` gives np.median's value bit for bit (odd and even counts, ties,
    nan and infinities; the detector's decisions depend on it), and np.median's own answer
    for what it hands over (empty, not float64, not 1-d)."""
    rng = np.random.default_rng(0)
    for t in range(2000):
        n = int(rng.integers(1, 80))
        x = rng.normal(size=n)
        if t % 3 == 0:
            x = np.round(x, 1)  # ties
        if t % 50 == 0:
            x[int(rng.integers(n))] = np.nan
        if t % 70 == 0:
            x[int(rng.integers(n))] = np.inf
        if t % 90 == 0:
            x[int(rng.integers(n))] = -np.inf
        a, b = float(np.median(x)), median(x)
        assert a == b or (math.isnan(a) and math.isnan(b)), (x, a, b)
        assert np.float64(a).tobytes() == np.float64(b).tobytes() or math.isnan(a)
    assert median(np.array([3, 1, 2, 4])) == 2.5  # (int: np.median's own)
    assert median(np.array([[1.0, 2.0], [3.0, 5.0]])) == 2.5
