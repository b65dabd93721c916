"""Robust statistics of a short series: its scale, where it splits, whether it rose.

Mechanism: the median absolute deviation as a noise scale, the split of a series into two
segments with the least absolute deviations from their medians, and Mann-Whitney's rank-sum
statistic as a z-score. These are what BOCD+V's verification (changepoint.py), the CUSUM
channels (cusum.py) and the onset placement (onset.py) measure levels and shifts with.

Guarantees: pure functions of their arguments (no state); a few outliers move none of them
much -- a spike neither sets the noise scale nor draws a split to itself, and a rank test
counts it as one sample whatever its size.
Cost: one sort per call (``rank_sum_z``: one comparison per pair of samples), ``best_split``
one per candidate; all on the few dozen samples of a detector's recent window. numpy only:
``scipy.stats`` (whose ``rankdata`` would give the same statistic) took 0.45 s of CPU to import
at every rank's start and rejoin, for one statistic (tests/detect/test_robust.py checks the
equality against it).
"""

from __future__ import annotations

import math

# numpy.ma: np.median imports it at its first call (~12-15 ms of CPU, mid-run on rank 0's
# analysis thread at a model's first start); here at import, with the rest of the monitor
import numpy as np
import numpy.ma  # noqa: F401

try:  # best_split's costs in one C call (detect/_native/channels.c); best_split_ref remains
    from stalwart.detect._channels import best_split as _best_split  # type: ignore[import-not-found]
except ImportError:  # no compiler at install (or an extension built before best_split)
    _best_split = None


def median(x: np.ndarray) -> float:
    """``np.median(x)`` of a 1-d array, the same value: the middle of the sorted values, or
    the mean of the two middle ones ((a + b) / 2, as np.median's mean of the two), nan when
    one is nan, a zero's sign np.median's own -- at one sort instead of np.median's ~10
    numpy calls (partition, the nan check, the mean; ~15 us each time on the few dozen
    samples of a detector's window, more after a training step evicts the caches). Anything
    but a non-empty float64 vector goes to np.median itself. tests/detect/test_robust.py
    compares the two bit for bit."""
    n = x.size
    if n == 0 or x.ndim != 1 or x.dtype != np.float64:
        return float(np.median(x))
    s = np.sort(x)
    if s[n - 1] != s[n - 1]:  # (sorted: a nan is last)
        return math.nan
    k = n // 2
    m = float(s[k]) if n % 2 else float((s[k - 1] + s[k]) / 2)
    # a zero: which of -0.0 and 0.0 (equal values) np.median's partition leaves in the
    # middle is its own choice -- asked of it (a rank that is its job's median reads 0.0)
    return float(np.median(x)) if m == 0.0 else m


def robust_scale(x: np.ndarray) -> float:
    """1.4826 * MAD: the standard deviation of Gaussian data, unmoved by a few outliers."""
    return float(1.4826 * median(np.abs(x - median(x))))


def _abs_dev(x: np.ndarray) -> float:
    """Sum of absolute deviations from the median: the upper half's sum minus the lower
    half's (the middle element of an odd count deviates by nothing) -- one sort instead of
    a median, a subtraction and an absolute value."""
    s = np.sort(x)
    k = len(s) // 2
    return float(s[len(s) - k:].sum() - s[:k].sum())


def best_split(v: np.ndarray, candidates: list[int]) -> int | None:
    """The index among ``candidates`` that splits ``v`` into two segments with the least
    absolute deviations from their medians (robust to a spike without clipping away the
    size of a real shift); the first of equals; None without candidates.

    One C call where built (``_channels.best_split``: the same costs to the bit -- numpy's
    pairwise sums of the same sorted values -- from one sort and an insertion per
    candidate, ~2-5 us where ``best_split_ref``'s two numpy sorts and four numpy calls per
    candidate cost ~250 us for a verification's 12 candidates); ``best_split_ref`` where it
    declines (a nan in ``v``, not a float64 vector, a candidate out of range).
    tests/detect/test_robust.py compares the two."""
    if _best_split is not None:
        got = _best_split(v, candidates)
        if got is not NotImplemented:
            return got
    return best_split_ref(v, candidates)


def best_split_ref(v: np.ndarray, candidates: list[int]) -> int | None:
    """``best_split`` in numpy (the reference the C call is tested against)."""
    best, best_i = math.inf, None
    for i in candidates:
        cost = _abs_dev(v[:i]) + _abs_dev(v[i:])
        if cost < best:
            best, best_i = cost, i
    return best_i


def _low_median(xs: np.ndarray) -> float:
    """The lower of the two middle values (of two samples: the smaller one)."""
    return float(np.sort(xs)[(len(xs) - 1) // 2])


def rise_onset(keys: np.ndarray, xs: np.ndarray, lo: int, hi: int,
               before: int = 20, min_rise: float = 0.0) -> int | None:
    """Where a series rose: the key in ``[lo, hi]`` that best splits it (``best_split``)
    into a lower segment (up to ``before`` samples earlier) and a higher one (to ``hi``).
    None if no split in the window leaves the later segment higher; with ``min_rise``, higher
    by more than that in its lower median (so a rise seen in one sample only is not placed).

    Used to place a compute straggler's onset on the culprit's own series: the channel that
    fired may have merged an earlier job-wide blip (an OS hiccup slows every rank's step)
    into the same slowdown and put its onset there.
    """
    order = np.argsort(keys, kind="stable")
    keys, xs = keys[order], xs[order]
    sel = (keys >= lo - before) & (keys <= hi)
    keys, xs = keys[sel], xs[sel]
    rising = [i for i in range(2, len(keys) - 1)  # two samples on each side at least
              if lo <= keys[i] <= hi and np.median(xs[i:]) > np.median(xs[:i])
              and (min_rise <= 0 or _low_median(xs[i:]) > np.median(xs[:i]) + min_rise)]
    i = best_split(xs, rising)
    return None if i is None else int(keys[i])


def rank_sum_z(before: np.ndarray, after: np.ndarray) -> float:
    """Mann-Whitney's rank-sum statistic of ``after`` against ``before`` as a z-score (normal
    approximation, average ranks for ties, no tie correction of the variance): large when
    ``after``'s values are above ``before``'s, whatever their scale. 0 for an empty side.

    Why a rank test: a level ratio of two medians of ~20 step times swung by 10-30% on a
    machine where the step time itself swings 17-48 ms from step to step (4 ranks on 2 cores);
    the ranks say whether the later samples are higher at all, not only by how much.
    """
    n1, n2 = len(before), len(after)
    if n1 == 0 or n2 == 0:
        return 0.0
    # U by its definition: pairs (later, earlier) where the later sample is higher, ties
    # counting a half -- equal to the rank sum of ``after`` under average ranks minus its
    # least value n2 (n2 + 1) / 2
    b = np.asarray(before, float)[None, :]
    a = np.asarray(after, float)[:, None]
    u = float(np.count_nonzero(a > b)) + 0.5 * float(np.count_nonzero(a == b))
    sd = math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12.0)
    return (u - n1 * n2 / 2.0) / sd


def drop_outliers(x: np.ndarray, z: float = 3.0) -> np.ndarray:
    """Samples within ``z`` robust standard deviations of the median."""
    if len(x) < 4:
        return x
    dev = np.abs(x - median(x))  # (``robust_scale``'s deviations, kept for the test)
    s = float(1.4826 * median(dev))
    if s <= 0:
        return x
    return x[dev <= z * s]

