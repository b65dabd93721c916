"""Persistent outliers: a rank slower than its peers all along, which no change point shows.

Why: the change-point channels (changepoint.py, cusum.py) learn each rank's level from its own
first samples, so a rank that is slow from its first step -- a bad node in the allocation, a
slower GPU generation -- never changes and is never examined. Here every rank is compared
with its peers at every step, all the time.

Mechanism: a sign test for the median. At each step, rank r's relative compute is
``x = compute_r / median(compute of the other ranks)``. Under the null hypothesis "rank r is
not a straggler by at least ``shift``" -- the median of x is at most ``1 + shift`` -- each
step has x > 1 + shift with probability at most 1/2, whatever the noise's distribution (the
sign test needs no model of it: CPU quota periods, other jobs and monitor work make the noise
heavy-tailed and different on every rank). Over the rank's last ``m`` samples
(``min_window`` <= m <= ``window``) the count k of such steps is compared with the binomial
tail: the rank is an outlier when ``P(Bin(m, 1/2) >= k) <= alpha_test``.

False-alarm rate: the test is evaluated every ``stride`` samples, so per rank and hour there
are ``3600 / (stride x step seconds)`` evaluations; with ``alpha_test = alpha x stride x
step_s / 3600`` (floored to a power of two) the union bound keeps the expected number of
alarms on a healthy rank at most ``alpha`` per rank-hour, at any step time, provided steps
are independent given the rank's level (serial correlation -- a burst of load lasting
seconds -- makes the true rate higher: the validation tests, which an alarm must pass before
anything is reported, are the second line). Only alarms are counted here: an alarm pauses
the job for the validation tests (localize.py) and names nothing by itself.

An alarm restarts the rank's window (one outlier, one alarm per window of evidence). An alarm
the tests did not confirm raises that rank's line to the level it was rejected at, x (1 +
``shift``): a rank that is structurally slower in this measure but not slow (rank 0 does the
monitor's work; the lossy transport's owner work) is not paused for again at that level.

Cost per step: O(n log n) for the peer medians (one sort), O(n) to update the windows, in one
C call (detect/_native/channels.c; ``_step`` is its numpy reference); a
test every ``stride`` steps is a comparison per rank with a cached critical count, and a
median over the window for a rank that passes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

import numpy as np

try:  # the per-step part in C (detect/_native/channels.c); ``OutlierBank._step`` is the reference
    from stalwart.detect._channels import outlier_step as _native_step  # type: ignore[import-not-found]
except ImportError:  # no compiler at install: the Python reference runs
    _native_step = None

ALPHA_RANK_HOUR = 1e-3  # expected alarms on a healthy rank, per rank-hour (union bound)
MIN_SHIFT = 0.10  # the null: the rank's median relative compute is at most 1 + this
WINDOW = 200  # samples of a rank's window, at most
MIN_WINDOW = 40  # samples before the first test (a 2x rank passes at ~36 of 40)
STRIDE = 5  # samples between tests


class Outlier(NamedTuple):
    """A rank whose relative compute exceeded its peers' median beyond chance."""

    rank: int
    onset: int  # key of the first sample of the window that made the case
    key: int  # decided at
    level: float  # median of compute / peers' median over the window
    excess: float  # median of (compute - peers' median) over the window, seconds
    count: int  # samples above 1 + shift...
    n: int  # ...of this many
    p: float  # the binomial tail P(Bin(n, 1/2) >= count)
    whole: bool  # the window held every sample of the rank since the warm-up


def binom_tail(n: int, k: int) -> float:
    """P(Bin(n, 1/2) >= k), exactly (integers; n up to a few thousand)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return math.fsum(math.comb(n, j) for j in range(k, n + 1)) / 2.0 ** n


@lru_cache(maxsize=4096)
def critical(n: int, log2_alpha: int) -> int:
    """The least k with P(Bin(n, 1/2) >= k) <= 2**log2_alpha (n + 1: none).

    The tail's terms in exact integers, each from the one before (C(n, k - 1) = C(n, k) k /
    (n - k + 1), an exact division): the same sums and the same float comparisons as
    ``_critical_comb``, which computes every term on its own (tests/detect/test_outlier.py
    compares the two), at ~1/3 of its cost -- a window length's count costs up to a few
    dozen big-integer operations, a new test level ~160 of them (``OutlierBank.crit_table``,
    on rank 0's analysis thread when the step time moves the level)."""
    alpha = 2.0 ** log2_alpha
    scale = 2.0 ** n
    total = 0
    term = 1  # C(n, n)
    for k in range(n, -1, -1):
        total += term
        if total / scale > alpha:
            return k + 1
        term = term * k // (n - k + 1)
    return 0


def _critical_comb(n: int, log2_alpha: int) -> int:
    """``critical``'s reference: each term of the tail by ``math.comb``."""
    alpha = 2.0 ** log2_alpha
    total = 0
    for k in range(n, -1, -1):
        total += math.comb(n, k)
        if total / 2.0 ** n > alpha:
            return k + 1
    return 0


def alpha_per_test(alpha_hour: float, stride: int, step_s: float) -> int:
    """log2 of the per-test level that keeps ``alpha_hour`` alarms per rank-hour (floored)."""
    per_test = alpha_hour * stride * max(step_s, 1e-6) / 3600.0
    return math.floor(math.log2(min(per_test, 0.5)))


def peer_medians(c: np.ndarray) -> np.ndarray:
    """For each rank, the median of the other ranks' values (one sort, O(n log n))."""
    n = len(c)
    order = np.argsort(c, kind="stable")
    s = c[order]
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    m = n - 1  # values left once a rank's own is taken out

    def reduced(j: int) -> np.ndarray:  # the j-th smallest of the others, for every rank
        return np.where(j < pos, s[j], s[min(j + 1, n - 1)])

    if m % 2:
        return reduced(m // 2)
    return 0.5 * (reduced(m // 2 - 1) + reduced(m // 2))


class OutlierBank:
    """The sign test of every rank against its peers (see the module docstring)."""

    def __init__(self, n: int, *, shift: float = MIN_SHIFT, window: int = WINDOW,
                 min_window: int = MIN_WINDOW, stride: int = STRIDE,
                 alpha: float = ALPHA_RANK_HOUR, warmup: int = 10) -> None:
        if n < 2 or not 0 < shift or min_window < 8 or window < min_window or stride < 1 \
                or not 0 < alpha:
            raise ValueError(f"bad outlier parameters: n={n} shift={shift} window={window} "
                             f"min_window={min_window} stride={stride} alpha={alpha}")
        self.n, self.shift, self.window, self.min_window = n, shift, window, min_window
        self.stride, self.alpha, self.warmup = stride, alpha, warmup
        self.line = np.full(n, 1.0 + shift)  # per rank: x above this counts
        self._keys = np.zeros(window, dtype=np.int64)
        self._over = np.zeros((n, window), dtype=bool)
        self._logrel = np.zeros((n, window))
        self._excess = np.zeros((n, window))
        self._pos = 0  # ring position of the next sample
        self.count = np.zeros(n, dtype=np.int64)  # samples over the line in each window
        self.filled = np.zeros(n, dtype=np.int64)  # samples in each rank's window
        self.seen = 0
        self.alarms = 0
        self.last_level = np.ones(n)  # the level of each rank's last alarm
        self._whole = np.ones(n, dtype=bool)  # no sample of the rank has left its window
        # by test level (log2 alpha): the critical count of each window length, for the
        # batched rows' test in C (``crit_table``)
        self._crit: dict[int, np.ndarray] = {}

    native = _native_step is not None  # the C step (the same arithmetic); False: the reference

    def add(self, key: int, comps: np.ndarray | list[float],
            step_s: float | Callable[[], float]) -> list[Outlier]:
        """One step: every rank's compute seconds (rank order) and the job's step time (or
        a function giving it, called only at a test); the ranks found to be outliers at this
        step (usually none)."""
        self.seen += 1
        if self.seen <= self.warmup:
            return []
        c = np.ascontiguousarray(comps, dtype=float)
        p = self._pos % self.window
        if self.native:
            assert _native_step is not None
            _native_step(self._over, self._logrel, self._excess, self._keys, self.count,
                         self.filled, self._whole, self.line, c, key, p)
        else:
            self._step(key, c, p)
        self._pos += 1
        if self._pos % self.stride:
            return []
        return self._test(key, step_s() if callable(step_s) else step_s)

    def _step(self, key: int, c: np.ndarray, p: int) -> None:
        """The reference of the C step (channels.c): every rank's sample into column ``p``
        of the windows (libm's log, as the C step takes)."""
        peers = peer_medians(c)
        x = c / peers
        full = self.filled >= self.window
        self._whole &= ~full
        self.count -= np.where(full, self._over[:, p], False)
        self.filled = np.where(full, self.filled, self.filled + 1)
        over = x > self.line
        self.count += over
        self._keys[p] = key
        self._over[:, p] = over
        self._logrel[:, p] = [math.log(v) for v in x.tolist()]
        self._excess[:, p] = c - peers

    def _test(self, key: int, step_s: float) -> list[Outlier]:
        """The ranks whose window passes the sign test now. The critical counts are looked
        up once per window length present and compared as one vector (a Python loop over
        10,000 ranks every ``stride`` steps before), so only the ranks that pass cost
        Python."""
        log2a = alpha_per_test(self.alpha, self.stride, step_s)
        ready = np.flatnonzero(self.filled >= self.min_window)
        if not ready.size:
            return []
        m_all = self.filled[ready]
        lengths = np.unique(m_all)
        crit = np.asarray([critical(int(m), log2a) for m in lengths.tolist()], dtype=np.int64)
        need = crit[np.searchsorted(lengths, m_all)]
        return self._alarms(key, ready[self.count[ready] >= need].tolist())

    def crit_table(self, log2a: int) -> np.ndarray:
        """The critical counts ``critical(m, log2a)`` by window length m (-1 below
        ``min_window``): the batched rows' path (``rel_rows``, channels.c) tests the windows
        with them and leaves a test that finds a rank to ``_test``. Made once per level met
        (~2.5 ms: the lengths a window passes through as it fills, looked up at once)."""
        tab = self._crit.get(log2a)
        if tab is None:
            tab = np.full(self.window + 1, -1, dtype=np.int64)
            for m in range(self.min_window, self.window + 1):
                tab[m] = critical(m, log2a)
            self._crit[log2a] = tab
        return tab

    def test_level(self, step_s: float) -> int:
        """log2 of the per-test level at step time ``step_s`` (``_test``'s)."""
        return alpha_per_test(self.alpha, self.stride, step_s)

    def _test_each(self, key: int, step_s: float) -> list[Outlier]:
        """``_test`` one rank at a time (the reference it is tested against)."""
        log2a = alpha_per_test(self.alpha, self.stride, step_s)
        ready = np.flatnonzero(self.filled >= self.min_window)
        passed = [r for r in ready.tolist()
                  if int(self.count[r]) >= critical(int(self.filled[r]), log2a)]
        return self._alarms(key, passed)

    def _alarms(self, key: int, passed: list[int]) -> list[Outlier]:
        out = []
        for r in passed:
            m, k = int(self.filled[r]), int(self.count[r])
            idx = (self._pos - 1 - np.arange(m)) % self.window
            level = math.exp(float(np.median(self._logrel[r, idx])))
            out.append(Outlier(r, int(self._keys[idx[-1]]), key, level,
                               float(np.median(self._excess[r, idx])), k, m, binom_tail(m, k),
                               bool(self._whole[r])))
            self.alarms += 1
            self.last_level[r] = level
            self.restart(r)
        return out

    def restart(self, rank: int) -> None:
        """The rank's window starts again with its next sample."""
        self.filled[rank] = 0
        self.count[rank] = 0
        self._whole[rank] = False

    def unconfirmed(self, rank: int) -> None:
        """The tests did not confirm the rank's last alarm: its line rises to that level."""
        self.line[rank] = max(self.line[rank], self.last_level[rank] * (1.0 + self.shift))
        self.restart(rank)
