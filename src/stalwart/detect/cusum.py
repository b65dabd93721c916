"""Page's CUSUM on every rank's relative compute: the small, lasting shifts BOCD+V lets pass.

Why a second detector: BOCD+V (changepoint.py) accepts a change only when most new samples
lie past the midpoint of the two levels. That rule is what keeps it silent on noise, and it
is also why a 1.3x compute straggler goes unseen: on this testbed a rank's compute time
relative to its peers' median jitters by 10-22% from step to step (CPU quota periods, other
jobs), and a 1.3x throttle moves it by only 14-20% (its peers' "compute" absorbs part of the
wait for its gradients), so a third of the new samples fall short of the midpoint.

Mechanism (Page, 1954), on ``x = log(compute / job median)`` of each rank:
- a reference of the rank's own healthy samples (``learn`` to ``history`` of them, after
  ``warmup``) gives its level ``mu0`` (median: hosts differ by a few percent) and its noise
  ``sigma`` (1.4826 x MAD, at least ``min_sigma``). Samples join the reference only once
  they are known not to be a change: while S is above 0 they wait, and when S falls back
  to 0 they join it. So the reference follows slow drifts and keeps growing (a reference
  of only ``learn`` samples moves ``mu0`` by ~0.3 sigma, which alone raised false alarms
  tenfold on synthetic noise), while the samples of a change never dilute it;
- ``S = max(0, S + clip(x - mu0, +-clip*sigma) - k)`` with ``k = log(1 + shift) / 2``: every
  sample above ``mu0 + k`` adds evidence, every sample below takes it away. A sample counts
  at most ``clip`` sigmas, so one outlier (an eval, a GC pause) cannot raise an alarm;
- an alarm when ``S > h * sigma`` (x ``backoff``). CUSUM is the optimal test for a shift of
  known size; with ``shift`` 20%, ``h`` 10 and ``clip`` 2.5, on synthetic
  log-normal noise of 17%, a 16% shift was found in a median of ~18 samples (18 of 20
  seeds within 61) with 4 alarms in 80,000 healthy rank-samples; replayed on this
  testbed's recorded clean runs it raised 24 alarms in 5,328 steps -- real drifts of the
  CPU shares of 4 ranks on 2 cores, which the validation tests must reject (``shift`` 12%
  and ``h`` 8 raised 68). The default ``shift`` is 15%: replayed on 23 recorded clean 4-rank
  runs and 8 with a 1.3x throttle (``tests/detect/cusum_replay.py``) it raised the same 2
  false alarms in 10,880 healthy rank-samples as
  20% and fired on the throttled rank 1-26 steps sooner (after 6-48 samples instead of 7-68).
  The onset is the first sample after S was last 0 (the CUSUM estimate of the change
  point: on the testbed's recorded 1.3x runs 0-4 steps late; on synthetic series of a shift
  near the noise level it erred by up to ~15 either way).
After an alarm the rank's reference is learnt again from the samples that follow, so one
shift raises one alarm; an alarm the validation tests did not confirm doubles that rank's
threshold (up to ``MAX_BACKOFF``), so drifting CPU shares cannot pause the job again and
again.

What it guarantees: bounded memory (``history`` samples per rank); an alarm
only after ``warmup + learn`` samples of the rank and only when the median of the samples
since the onset is at least ``1 + shift/2`` times ``mu0``. Cost: one C call per step for all
ranks (detect/_native/channels.c; ``_step`` is its numpy reference, ~120 us for 4 ranks on
rank 0 after a training step), plus a refit (two masked medians over all ranks) every
``REFIT_EVERY`` steps. Alarms
are evidence, not verdicts: the monitor still runs the validation tests, which must confirm
the rank (localize.py).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

from stalwart.detect.changepoint import Change
from stalwart.detect.robust import median, robust_scale

try:  # the per-step part in C (detect/_native/channels.c); ``CusumBank._step`` is the reference
    from stalwart.detect._channels import cusum_step as _native_step  # type: ignore[import-not-found]
except ImportError:  # no compiler at install: the Python reference runs
    _native_step = None
try:  # the refit in C (an extension built before it has only the step)
    from stalwart.detect._channels import cusum_refit as _native_refit  # type: ignore[import-not-found]
except ImportError:
    _native_refit = None

# The job size the per-rank thresholds were tuned on (4 testbed ranks). Each rank's channel is
# a test of its own; with n of them the job pauses for a noise alarm n times as often, so above
# this size every per-rank test is made n/REF_RANKS times as strict (Bonferroni): the job-wide
# rate of noise alarms stays what it was at 4 ranks. Without it the simulator's 10,000-rank job
# paused for validation almost every step (docs/simulate.md).
REF_RANKS = 4


def per_rank_z(n: int, z: float = 2.5, ref: int = REF_RANKS) -> float:
    """The significance (in standard errors) a per-rank change must reach among ``n`` ranks
    so that the job's chance of a noise alarm is what ``z`` gave at ``ref`` ranks: the
    one-sided normal tail ``ref / n`` times as small. ``z`` itself for ``n <= ref``."""
    if n <= ref:
        return z
    return -NormalDist().inv_cdf(NormalDist().cdf(-z) * ref / n)


def _row_medians(a: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Median of each row's first ``counts`` values once sorted (the rest are +inf): one
    sort of the block (numpy's nanmedian goes through masked arrays, ~100x slower here)."""
    s = np.sort(a, axis=1)
    lo = np.take_along_axis(s, ((counts - 1) // 2)[:, None], axis=1)[:, 0]
    hi = np.take_along_axis(s, (counts // 2)[:, None], axis=1)[:, 0]
    return 0.5 * (lo + hi)


class CusumBank:
    """One-sided (upward) CUSUM per rank, all ranks updated together."""

    MAX_BACKOFF = 4.0
    REFIT_EVERY = 16
    LAG = 24  # a sample joins the reference this many steps late at the earliest

    def __init__(self, n: int, *, shift: float = 0.15, h: float = 10.0, clip: float = 2.5,
                 warmup: int = 10, learn: int = 18, history: int = 200,
                 min_sigma: float = 0.02, ref: int = REF_RANKS) -> None:
        """``ref``: with more than ``ref`` ranks each rank's threshold rises so that the
        job-wide rate of noise alarms stays what ``h`` gave at ``ref`` ranks (``threshold``)."""
        if n < 1 or shift <= 0 or h <= 0 or clip <= 0 or learn < 4 or history < learn:
            raise ValueError(f"bad CUSUM parameters: n={n} shift={shift} h={h} clip={clip} "
                             f"learn={learn} history={history}")
        self.n = n
        self.k = 0.5 * math.log1p(shift)
        self.shift = shift
        self.h = h
        self.clip = clip
        self.warmup = warmup
        self.learn = learn
        self.history = history
        self.min_sigma = min_sigma
        self._log_n = math.log(n / ref) if n > ref else 0.0
        self.seen = np.zeros(n, dtype=np.int64)  # samples since (re)start, warm-up included
        self.start_key = np.zeros(n, dtype=np.int64)  # first key of the reference
        self.mu0 = np.zeros(n)
        self.sigma = np.full(n, np.nan)  # nan: still learning
        self.s = np.zeros(n)
        # last key with S == 0: the reference is every sample from start_key to it (the
        # samples after it wait until S falls back to 0, or belong to the change)
        self.zero_key = np.zeros(n, dtype=np.int64)
        self._keys = np.full((n, history), -1, dtype=np.int64)  # recent samples, a ring
        self._xs = np.zeros((n, history))
        self._pos = 0
        self.alarms = 0
        # per rank: x the threshold; doubled after each alarm the validation tests did not
        # confirm (up to MAX_BACKOFF), back to 1 after one they did
        self.backoff = np.ones(n)
        self._live = np.zeros(n, dtype=bool)  # the C step's live mask (ranks with a sigma)

    def unconfirmed(self, rank: int) -> None:
        self.backoff[rank] = min(self.MAX_BACKOFF, 2.0 * self.backoff[rank])

    def confirmed(self, rank: int) -> None:
        self.backoff[rank] = 1.0

    def restart(self, rank: int) -> None:
        """Learn the rank's level and noise again from the next samples."""
        self.seen[rank] = self.warmup  # no second warm-up: the job is past its start
        self.sigma[rank] = np.nan
        self.s[rank] = 0.0

    def _fit(self, r: int, upto: int) -> None:
        """Rank ``r``'s level and noise from its reference (the reference ``_fit_many`` is
        tested against)."""
        keys = self._keys[r]
        ref = self._xs[r][(keys >= self.start_key[r]) & (keys <= upto)]
        self.mu0[r] = median(ref)
        self.sigma[r] = max(self.min_sigma, robust_scale(ref))

    def _fit_many(self, rows: list[int], upto: int) -> None:
        """``_fit`` of every rank in ``rows``, in one masked pass (every rank's first fit
        falls due at the same step: at 10,000 ranks one ``_fit`` each took ~1.5 s of that
        step). The same values: the same medians (the middle value, or the two middle
        ones' mean) of the same deviations (tests/detect/test_cusum_fit.py)."""
        if len(rows) < 2:
            for r in rows:
                self._fit(int(r), upto)
            return
        idx = np.asarray(rows, dtype=np.int64)
        keys, xs = self._keys[idx], self._xs[idx]
        mask = (keys >= self.start_key[idx][:, None]) & (keys <= upto)
        counts = mask.sum(axis=1)
        if not counts.all() or not np.isfinite(xs[mask]).all():
            for r in rows:  # (an empty or non-finite reference: numpy's own median)
                self._fit(int(r), upto)
            return
        mu = _row_medians(np.where(mask, xs, np.inf), counts)
        dev = np.where(mask, np.abs(xs - mu[:, None]), np.inf)
        self.mu0[idx] = mu
        self.sigma[idx] = np.maximum(self.min_sigma, 1.4826 * _row_medians(dev, counts))

    def _refit(self, live: np.ndarray, key: int) -> None:
        """Every live rank's level and noise from its reference, in one masked pass: the
        reference moves slowly, so this runs every ``REFIT_EVERY`` steps. With the C step,
        in C (``cusum_refit``: one selection per median instead of numpy's masked sorts,
        ~60 ms a refit at 10,000 ranks); this is its reference (tests/detect/
        test_cusum_refit.py checks the equality)."""
        if self.native and _native_refit is not None and live is self._live:
            _native_refit(self._keys, self._xs, self.seen, self.start_key, self.mu0,
                          self.sigma, self.s, self.zero_key, self.backoff, self._live, key,
                          self.LAG, self.min_sigma, self.learn)
            return
        self._refit_py(live, key)

    def _refit_py(self, live: np.ndarray, key: int) -> None:
        """``_refit`` in numpy: the reference."""
        upto = np.minimum(self.zero_key, key - self.LAG)[:, None]
        inref = (self._keys >= self.start_key[:, None]) & (self._keys <= upto)
        ok = live & (inref.sum(axis=1) >= self.learn)
        if not ok.any():
            return
        mask = inref[ok]
        mu = _row_medians(np.where(mask, self._xs[ok], np.inf), mask.sum(axis=1))
        dev = np.where(mask, np.abs(self._xs[ok] - mu[:, None]), np.inf)
        self.mu0[ok] = mu
        self.sigma[ok] = np.maximum(self.min_sigma,
                                    1.4826 * _row_medians(dev, mask.sum(axis=1)))

    native = _native_step is not None  # the C step (the same arithmetic); False: the reference

    def add(self, key: int, ratios: np.ndarray | list[float]) -> list[Change | None]:
        """One step: every rank's compute / job median. Returns each rank's alarm (or None)."""
        col = self._pos % self.history
        self._pos += 1
        if self.native:
            assert _native_step is not None
            fits, alarms = _native_step(
                self._keys, self._xs, self.seen, self.start_key, self.mu0, self.sigma,
                self.s, self.zero_key, self.backoff, self._live,
                np.ascontiguousarray(ratios, dtype=float), key, col, self.warmup,
                self.learn, self.k, self.clip, self.h, self._log_n)
            live = self._live
        else:
            fits, alarms, live = self._step(key, ratios, col)
        return self.after_step(key, fits, alarms, live)

    def after_step(self, key: int, fits: list[int], alarms: list[int],
                   live: np.ndarray) -> list[Change | None]:
        """The rest of ``add`` after its step (the C step's or ``_step``'s ``fits``, ``alarms``
        and live mask, the position already advanced): the fits, the refit every
        ``REFIT_EVERY`` steps, the alarms. Also the batched rows' path (``rel_rows``,
        channels.c) for a row whose step left any of these. Each rank's alarm (or None)."""
        out: list[Change | None] = [None] * self.n
        if len(fits):
            self._fit_many(fits, key)
            self.s[fits] = 0.0
            self.zero_key[fits] = key
        if not fits and not alarms and self._pos % self.REFIT_EVERY:
            return out  # the common step: nothing else to do
        if not live.any():
            return out
        if self._pos % self.REFIT_EVERY == 0:
            self._refit(live, key)
        for r in alarms:
            ch = self._alarm(int(r), key)
            if ch is not None:
                out[int(r)] = ch
        return out

    def _step(self, key: int, ratios: np.ndarray | list[float],
              col: int) -> tuple[list[int], list[int], np.ndarray]:
        """The reference of the C step (channels.c): the sample into ring column ``col``,
        S and the last zero of every live rank; the ranks due for a fit, the ranks past
        their threshold (with the noise scales on entry) and the live mask."""
        x = np.array([math.log(max(float(r), 1e-9)) for r in ratios])
        self._keys[:, col] = key
        self._xs[:, col] = x
        self.seen += 1
        self.start_key[self.seen == self.warmup + 1] = key
        learning = np.isnan(self.sigma)
        fits = np.flatnonzero(learning & (self.seen >= self.warmup + self.learn)).tolist()
        live = ~learning
        sig = np.where(live, self.sigma, 1.0)
        inc = np.clip(x - self.mu0, -self.clip * sig, self.clip * sig) - self.k
        s = np.where(live, np.maximum(0.0, self.s + inc), 0.0)
        self.zero_key = np.where(live & (s == 0.0), key, self.zero_key)
        self.s = s
        alarms = np.flatnonzero(live & (s > self.threshold(sig))).tolist()
        return fits, alarms, live

    def threshold(self, sig: np.ndarray) -> np.ndarray:
        """Each rank's alarm level on S. Siegmund's approximation of the in-control run
        length, ARL0 ~ exp(2 (k / sigma) (h + 1.166)) in sigma units, grows n/ref-fold when h
        grows by log(n / ref) sigma / (2 k): the noisier the rank, the larger that step (at
        sigma 0.16 and 10,000 ranks, h 10 -> 19; at sigma 0.02, 10 -> 11)."""
        extra = self._log_n * sig / (2.0 * self.k)
        return (self.h + extra) * self.backoff * sig

    def _alarm(self, r: int, key: int) -> Change | None:
        onset = int(self.zero_key[r]) + 1
        keys = self._keys[r]
        after = self._xs[r][(keys >= onset) & (keys <= key)]
        mu0 = float(self.mu0[r])
        # the level itself must have moved, not just a run of bad luck at the clip
        if after.size == 0:
            return None
        level = median(after)
        if level - mu0 < 0.5 * math.log1p(self.shift):
            return None
        self.alarms += 1
        self.restart(r)
        return Change(onset, key, math.exp(mu0), math.exp(level))
