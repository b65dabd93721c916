"""Bayesian online change-point detection with verification ("BOCD+V", FALCON/Greyhound).

Mechanism: Adams & MacKay's BOCPD on log iteration times, Normal-Gamma conjugate model
(Student-t predictive), constant hazard, run-length posterior truncated to ``max_run``.
FALCON accepts a change point only if the level before and after differs by >= 10%, after
dropping |z| > 3 outliers, with change points >= 10 iterations apart; that verification is
what took their false-positive rate from 18-34% to 0%.

Guarantees of ``ChangeDetector``:
- memory is bounded (posterior of at most ``max_run`` entries, segments capped);
- the first ``warmup`` samples are ignored (allocation, caches, lazy init);
- a change is reported only after ``confirm`` samples of the new regime, only if the level
  moved by >= ``min_shift`` (mean of the segment before with |z|>3 outliers removed vs the
  median of the new regime -- robust with only a few samples), only if that move is
  significant for the series' noise (2.5 standard errors) with >= 75% of the new samples past
  the midpoint of the two levels, and only ``min_spacing``
  samples or more after the previous accepted change -- so one outlier (an eval step, a GC
  pause) is never reported;
- ``onset`` is the first sample of the new regime as located by the posterior.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np


def robust_scale(x: np.ndarray) -> float:
    """1.4826 * MAD: the standard deviation of Gaussian data, unmoved by a few outliers."""
    return float(1.4826 * np.median(np.abs(x - np.median(x))))


def drop_outliers(x: np.ndarray, z: float = 3.0) -> np.ndarray:
    """Samples within ``z`` robust standard deviations of the median."""
    if len(x) < 4:
        return x
    s = robust_scale(x)
    if s <= 0:
        return x
    return x[np.abs(x - np.median(x)) <= z * s]


class BOCPD:
    """Run-length posterior of Adams & MacKay's BOCPD with a Normal-Gamma model.

    Convention: run length r >= 1 counts the samples of the current segment including the
    newest one; ``posterior[r-1]`` is P(run length = r | data).

    Cost: one update is ~15 vector operations over the run lengths. Of the Normal-Gamma
    parameters only ``mu`` and ``beta`` depend on the data: ``kappa = kappa0 + n`` and
    ``alpha = alpha0 + n/2`` depend only on the number n of samples a hypothesis has
    absorbed, so every term built from them (the Student-t's lgamma ratio and scale factor,
    the update weights) is tabulated once per detector. The posterior is kept in log space,
    so no logarithm of it is taken per update.
    """

    def __init__(self, mu0: float, scale: float, hazard: float = 1 / 200,
                 max_run: int = 300, kappa0: float = 0.1, alpha0: float = 5.0) -> None:
        self.hazard = hazard
        self.max_run = max_run
        self.prior = (mu0, kappa0, alpha0, scale * scale * (alpha0 - 1.0))
        self._log_h = math.log(hazard)
        self._log_1mh = math.log1p(-hazard)
        # tables over n = samples absorbed, 0 (the prior) .. max_run
        n = np.arange(max_run + 1, dtype=float)
        kappa = kappa0 + n
        alpha = alpha0 + 0.5 * n
        nu = 2.0 * alpha
        lg = np.array([math.lgamma((v + 1) / 2) - math.lgamma(v / 2) for v in nu])
        # Student-t predictive: var = beta (kappa+1) / (alpha kappa), so
        # log p(x) = c - 0.5 log(beta) - e log1p(f (x-mu)^2 / beta)
        self._c = lg - 0.5 * np.log(nu * math.pi * (kappa + 1.0) / (alpha * kappa))
        self._e = (nu + 1.0) / 2.0
        self._f = kappa / (2.0 * (kappa + 1.0))  # also beta's update weight
        self._g = 1.0 / (kappa + 1.0)  # mu's update weight
        # parameters of the hypotheses, index n = samples absorbed; index 0 is the prior
        self._mu = np.empty(max_run + 2)
        self._beta = np.empty(max_run + 2)
        self._mu[0], self._beta[0] = mu0, self.prior[3]
        self._n = 0  # hypotheses held (run lengths 1 .. _n)
        self._logpost = np.empty(0)
        self.posterior = np.empty(0)

    def update(self, x: float) -> np.ndarray:
        n = self._n
        mu, beta = self._mu[:n + 1], self._beta[:n + 1]
        d = x - mu
        d2 = d * d
        lp = self._c[:n + 1] - 0.5 * np.log(beta) - self._e[:n + 1] * np.log1p(
            self._f[:n + 1] * d2 / beta)
        logs = np.empty(n + 1)
        logs[0] = self._log_h + lp[0]  # a new segment starts with x
        logs[1:] = self._logpost + (self._log_1mh + lp[1:])  # every run grows by one
        m = logs.max()
        logs -= m
        post = np.exp(logs)
        total = post.sum()
        post /= total
        logs -= math.log(total)
        # parameters after x, for n = 1 .. n+1 (the prior stays at index 0)
        new_mu = mu + d * self._g[:n + 1]
        new_beta = beta + self._f[:n + 1] * d2
        self._mu[1:n + 2] = new_mu
        self._beta[1:n + 2] = new_beta
        if n + 1 > self.max_run:
            # Fold the longest run into the cap instead of dropping it: dropping the mass of a
            # long stable segment would make a recent change look certain.
            post[self.max_run - 1] += post[self.max_run:].sum()
            post = post[:self.max_run]
            logs = logs[:self.max_run]
            logs[-1] = math.log(post[-1]) if post[-1] > 0 else -math.inf
            n = self.max_run - 1
        self._n = n + 1
        self._logpost = logs
        self.posterior = post
        return post


@dataclass
class Change:
    """A verified change point in a series of iteration times."""

    onset: int  # key (step) of the first sample of the new regime
    decided: int  # key of the sample at which the change was accepted
    before: float  # level before (seconds)
    after: float  # level after (seconds)

    @property
    def ratio(self) -> float:
        return self.after / self.before


class ChangeDetector:
    """Streaming BOCD+V over (key, iteration time) samples; ``add`` returns a ``Change``."""

    def __init__(self, warmup: int = 10, min_baseline: int = 8, min_shift: float = 0.10,
                 min_spacing: int = 10, threshold: float = 0.9, confirm: int = 3,
                 max_lag: int = 12, hazard: float = 1 / 200, min_scale: float = 0.01,
                 history: int = 400, z_sig: float = 2.5, clip: float = 4.0) -> None:
        self.clip = clip
        self.z_sig = z_sig
        self.warmup = warmup
        self.min_baseline = min_baseline
        self.min_shift = min_shift
        self.min_spacing = min_spacing
        self.threshold = threshold
        self.confirm = confirm
        self.max_lag = max_lag
        self.hazard = hazard
        self.min_scale = min_scale
        self.seen = 0
        self._keys: deque[int] = deque(maxlen=history)  # current segment
        self._vals: deque[float] = deque(maxlen=history)  # log times of the current segment
        self._bocpd: BOCPD | None = None
        self._scale: float | None = None  # noise scale in log space, from the first segment
        self._scale_n = 0  # samples the scale was estimated from
        self._last_onset_pos: int | None = None  # sample position of last accepted onset
        self._last_up = False  # direction of the last accepted change
        self._pos = 0  # position of the next sample (counts samples after warm-up)
        self._seg_start_pos = 0
        self.changes: list[Change] = []
        # True after a sample at which the posterior already put a change within the last
        # ``max_lag`` samples but verification has not accepted it (yet): a cheap "something
        # may be starting" signal, e.g. to exchange data sooner while it is confirmed
        self.pending = False

    @property
    def level(self) -> float | None:
        """Current regime's level (seconds), None before a baseline exists."""
        if len(self._vals) < 1:
            return None
        return float(math.exp(np.median(np.asarray(self._vals)[-self.min_baseline:])))

    def _start_bocpd(self) -> None:
        v = np.asarray(self._vals)
        if self._scale is None:
            self._scale = max(robust_scale(v), self.min_scale)
            self._scale_n = len(v)
        centre = float(np.median(v))
        self._bocpd = BOCPD(centre, self._scale, hazard=self.hazard)
        c = self.clip * self._scale
        for x in v:
            self._bocpd.update(min(max(float(x), centre - c), centre + c))

    def _refresh_scale(self) -> None:
        # The noise scale first comes from min_baseline samples, too few to trust: re-estimate
        # it each time the segment doubles, leaving out the newest samples (maybe a change).
        n = len(self._vals) - self.max_lag
        if n >= 2 * self._scale_n:
            self._scale = max(robust_scale(np.asarray(self._vals)[:n]), self.min_scale)
            self._scale_n = n

    def _best_split(self, lag: int) -> int:
        """Length of the new regime (1..lag) minimising the two segments' absolute deviations.

        Absolute deviations from medians: robust to a spike without clipping away the size of
        a real shift.
        """
        v = np.asarray(self._vals)
        best, best_run = math.inf, 1
        for run in range(1, lag + 1):
            a, b = v[:-run], v[-run:]
            if len(a) < 2:
                break
            cost = float(np.abs(a - np.median(a)).sum() + np.abs(b - np.median(b)).sum())
            if cost < best:
                best, best_run = cost, run
        return best_run

    def add(self, key: int, seconds: float) -> Change | None:
        self.seen += 1
        self.pending = False
        if self.seen <= self.warmup or not seconds > 0 or not math.isfinite(seconds):
            return None
        x = math.log(seconds)
        pos = self._pos
        self._pos += 1
        self._keys.append(key)
        self._vals.append(x)
        if self._bocpd is None:
            if len(self._vals) >= self.min_baseline:
                self._start_bocpd()
            return None
        # Winsorise what the model sees to +-clip robust scales around the segment's level:
        # a rare spike must not teach the model a wide variance that would then hide a real
        # shift (a real shift still shows as a run of samples pinned at the clip).
        self._refresh_scale()
        centre = self._bocpd.prior[0]
        c = self.clip * (self._scale or self.min_scale)
        post = self._bocpd.update(min(max(x, centre - c), centre + c))
        seg_len = len(self._vals)
        lag = min(self.max_lag, seg_len - 1)
        if lag < 1:
            return None
        if post[:lag].sum() <= self.threshold:
            return None
        self.pending = True
        # The posterior says "a change within the last `lag` samples"; where exactly is left to
        # the data: short runs with uncertain variance tend to absorb the first new samples, so
        # the posterior's own argmax places the onset a few samples early.
        run = self._best_split(lag)
        if run < self.confirm:
            return None
        onset_pos = pos - run + 1
        vals = np.asarray(self._vals)
        before = drop_outliers(vals[:-run])
        after = vals[-run:]
        if len(before) < 2:
            return None
        lb, la = float(np.mean(before)), float(np.median(after))
        ratio = math.exp(la - lb)
        if abs(ratio - 1.0) < self.min_shift:
            return None
        # The shift must also be significant for the noise of this series (a median of n
        # samples has ~1.25 s / sqrt(n) spread), and most of the new samples must lie on the
        # far side of the midpoint -- two unrelated spikes close together are not a regime.
        s = max(robust_scale(before), self._scale or 0.0, self.min_scale)
        if abs(la - lb) < self.z_sig * 1.25 * s / math.sqrt(run):
            return None
        mid = (la + lb) / 2
        far = np.sum(after > mid) if la > lb else np.sum(after < mid)
        if far < 0.75 * run:
            return None
        # Spacing applies to changes in the same direction (one ramp is one change). A change
        # back the other way may follow sooner: otherwise a brief spurious speed-up would hide
        # a real slowdown that starts a few iterations later.
        up = la > lb
        if self._last_onset_pos is not None and up == self._last_up and \
                onset_pos - self._last_onset_pos < self.min_spacing:
            return None
        keys = list(self._keys)
        change = Change(onset=keys[-run], decided=key, before=math.exp(lb), after=math.exp(la))
        self.pending = False
        self.changes.append(change)
        self._last_onset_pos = onset_pos
        self._last_up = up
        # the new regime becomes the segment; the noise scale learnt at the start is kept
        new_keys, new_vals = keys[-run:], list(vals[-run:])
        self._keys.clear()
        self._vals.clear()
        self._keys.extend(new_keys)
        self._vals.extend(new_vals)
        self._start_bocpd()
        return change

    def force_change(self, onset: int, decided: int) -> None:
        """Start a new segment at key ``onset`` (another rank decided; keep in agreement)."""
        keys, vals = list(self._keys), list(self._vals)
        keep = [i for i, k in enumerate(keys) if k >= onset]
        if not keep:
            return
        self._keys.clear()
        self._vals.clear()
        self._keys.extend(keys[i] for i in keep)
        self._vals.extend(vals[i] for i in keep)
        self._last_onset_pos = self._pos - len(keep)
        self._start_bocpd()
