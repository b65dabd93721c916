"""robust.rank_sum_z against scipy's rank-sum statistic (average ranks for ties)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import rankdata

from stalwart.detect.robust import rank_sum_z


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
