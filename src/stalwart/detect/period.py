"""Iteration period from the collective-op sequence alone (FALCON/Greyhound tracking stage).

Mechanism (Wu et al., "FALCON"/"Greyhound", ATC '25): a training job issues the same sequence
of collectives every iteration, so the op-type sequence is periodic. The period is the first
lag k whose autocorrelation ACF_k >= 0.95, accepted only once the last periods repeat exactly.
Iteration time is then the gap between the same op one period apart -- no call from the user's
training loop is needed.

Guarantees:
- ``find_period`` returns a period only if the sequence's last ``repeats`` periods are
  symbol-for-symbol identical (the ACF alone can alias on short or sparse sequences);
- the ACF is computed on a one-hot encoding of the symbols, so the numeric codes given to op
  kinds do not matter;
- ``PeriodTracker`` is streaming and deterministic in the op index: ranks that see the same
  op sequence find the same period at the same op and agree on iteration boundaries, which is
  what lets them pause at the same collective boundary without talking to each other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

ACF_THRESHOLD = 0.95


def acf(symbols: Sequence[int], max_lag: int) -> np.ndarray:
    """ACF_k for k = 0..max_lag of a categorical sequence (one-hot, summed over categories).

    ACF_k = mean_t <x_t - mu, x_{t+k} - mu> / mean_t |x_t - mu|^2, the paper's formula applied
    to one-hot vectors (with means instead of sums so that short windows are not biased).
    A constant sequence has zero variance: every lag is reported as 1.0
    (it repeats with any period).
    """
    x = np.asarray(symbols)
    n = len(x)
    max_lag = min(max_lag, n - 1)
    out = np.ones(max_lag + 1)
    if n == 0:
        return out
    cats, codes = np.unique(x, return_inverse=True)
    if len(cats) == 1:
        return out
    onehot = np.zeros((n, len(cats)))
    onehot[np.arange(n), codes] = 1.0
    centred = onehot - onehot.mean(axis=0)
    denom = float((centred * centred).sum()) / n
    for k in range(1, max_lag + 1):
        # per-pair mean (the "unbiased" estimate): with the plain sum an exactly periodic
        # sequence of length n could never reach 0.95 at lag k > 0.05 n
        out[k] = float((centred[:-k] * centred[k:]).sum()) / (n - k) / denom
    return out


def repeats_exactly(symbols: Sequence[Hashable], period: int, repeats: int) -> bool:
    """True if the last ``repeats`` blocks of length ``period`` are identical."""
    need = period * repeats
    if period < 1 or len(symbols) < need:
        return False
    tail = list(symbols)[-need:]
    first = tail[:period]
    return all(tail[i * period:(i + 1) * period] == first for i in range(1, repeats))


def find_period(symbols: Sequence[int], max_period: int | None = None, repeats: int = 3,
                threshold: float = ACF_THRESHOLD) -> int | None:
    """First lag with ACF >= threshold that is confirmed by exact repetition, else None."""
    n = len(symbols)
    if max_period is None:
        max_period = n // repeats
    max_period = min(max_period, n // repeats)
    if max_period < 1:
        return None
    r = acf(symbols, max_period)
    for k in range(1, max_period + 1):
        # The ACF finds the candidate; exact repetition rejects aliases (e.g. a lag that is
        # only almost periodic because one op kind dominates the sequence).
        if r[k] >= threshold and repeats_exactly(symbols, k, repeats):
            return k
    return None


@dataclass
class Boundary:
    """One completed iteration found from the op sequence."""

    index: int  # op index (in the period sequence) that starts the next iteration
    start: float  # issue time of the op that started the iteration
    end: float  # issue time of the same op one period later


class PeriodTracker:
    """Streaming period finder over op symbols; emits an iteration boundary per period.

    ``push(symbol, t)`` returns a ``Boundary`` when the op starts a new iteration. While no
    period is known it re-runs ``find_period`` every ``check_every`` ops on the last
    ``window`` symbols; a symbol that breaks the known pattern drops the period and starts
    the search again (e.g. the job changed phase).
    """

    def __init__(self, window: int = 512, check_every: int = 8, max_period: int = 128,
                 repeats: int = 3) -> None:
        self.window = window
        self.check_every = check_every
        self.max_period = max_period
        self.repeats = repeats
        self._sym: deque[int] = deque(maxlen=window)
        self._times: deque[float] = deque(maxlen=window)
        self.count = 0  # ops pushed so far
        self.period: int | None = None
        self._phase0 = 0  # op index (mod period) that starts an iteration
        self._since_check = 0

    def _search(self) -> int | None:
        # Trailing windows of growing length: old ops (start-up, a previous phase) would
        # otherwise pull the ACF of a clean recent pattern below the threshold.
        syms = list(self._sym)
        n = 16
        while True:
            p = find_period(syms[-n:], self.max_period, self.repeats)
            if p is not None or n >= len(syms):
                return p
            n *= 2

    def push(self, symbol: int, t: float) -> Boundary | None:
        idx = self.count
        self.count += 1
        if self.period is not None:
            p = self.period
            if len(self._sym) >= p and self._sym[-p] != symbol:
                self.period = None  # pattern broken: search again from here
                self._sym.clear()
                self._times.clear()
                self._since_check = 0
        self._sym.append(symbol)
        self._times.append(t)
        if self.period is None:
            self._since_check += 1
            if self._since_check >= self.check_every:
                self._since_check = 0
                p = self._search()
                if p is not None:
                    self.period = p
                    self._phase0 = (idx + 1) % p  # next op starts an iteration
            return None
        p = self.period
        if (idx - self._phase0) % p == 0 and len(self._times) > p:  # one period apart
            return Boundary(index=idx, start=self._times[-1 - p], end=t)
        return None
