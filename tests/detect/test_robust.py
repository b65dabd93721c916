"""robust.rank_sum_z against scipy's rank-sum statistic (average ranks for ties)."""

from __future__ import annotations

import math

import numpy as np
import pytest
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


def test_best_split_is_the_numpy_references_exactly() -> None:
    """The C call's split equals ``best_split_ref``'s on random series: lengths across
    numpy's pairwise-sum blocks (8, 128, the halves above), repeated values and ties,
    spikes, infinities, candidates in any order and with repeats; a nan, a non-float64
    vector or a strided view go to the reference."""
    from stalwart.detect import robust

    if robust._best_split is None:
        pytest.skip("detect._channels not built")
    rng = np.random.default_rng(7)
    for t in range(4000):
        n = int(rng.integers(0, 420))
        kind = t % 4
        if kind == 0:
            v = rng.normal(0.0, 1.0, n)
        elif kind == 1:  # few distinct values: equal costs, the first must win
            v = rng.integers(0, 3, n).astype(float)
        elif kind == 2:  # a shift and a spike, scaled far from 1
            v = np.log(rng.lognormal(0.0, 0.1, n)) * 10.0 ** float(rng.integers(-8, 9))
            if n > 4:
                v[n // 2:] += 0.3
                v[int(rng.integers(0, n))] *= 50.0
        else:
            v = rng.normal(0.0, 1.0, n)
            if n:
                v[int(rng.integers(0, n))] = rng.choice([math.inf, -math.inf])
        cands = [int(c) for c in rng.integers(0, n + 1, int(rng.integers(0, 14)))]
        if t % 3 == 0:  # the verification's candidates: runs 1..12 from the end
            cands = [n - run for run in range(1, 13) if n - run >= 2]
        assert robust.best_split(v, cands) == robust.best_split_ref(v, cands), (t, n)
    v = rng.normal(0.0, 1.0, 50)
    v[3] = math.nan
    assert robust._best_split(v, [10, 20]) is NotImplemented
    assert robust._best_split(v.astype(np.float32), [10]) is NotImplemented
    assert robust._best_split(v[::2], [10]) is NotImplemented
    assert robust._best_split(v, [51]) is NotImplemented
    assert robust.best_split(v, []) is None


def test_drop_outliers_keeps_what_robust_scale_says() -> None:
    """``drop_outliers`` equals its definition: the samples within z robust standard
    deviations (``robust_scale``) of the median."""
    from stalwart.detect.robust import drop_outliers, robust_scale

    rng = np.random.default_rng(3)
    for t in range(2000):
        x = rng.normal(0.0, 1.0, int(rng.integers(0, 60)))
        if t % 3 == 0 and len(x):
            x[int(rng.integers(0, len(x)))] = 40.0
        if t % 7 == 0:
            x = np.round(x)  # a zero scale: every sample kept
        want = x
        if len(x) >= 4 and robust_scale(x) > 0:
            want = x[np.abs(x - median(x)) <= 3.0 * robust_scale(x)]
        assert np.array_equal(drop_outliers(x), want)
