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

Cost: a pre-filter keeps the model asleep while nothing can be verified. Verification needs
the median of at least ``confirm`` new samples to sit ``min_shift`` (and 2.5 standard errors)
from the old level, so no change can be accepted before two of three samples in a row lie
half that distance from the segment's centre. Until they do, a sample costs a few scalar
operations (no model update); when they do, the model is rebuilt from the segment's last
``REPLAY`` samples (the posterior forgets older ones anyway: a change must be within
``max_lag`` samples to count) and updated every sample until ``max_lag`` samples in a row are
quiet again. On a clean tiny-preset run this cut the detector's per-sample CPU several-fold
(docs/BENCHMARKS.md); ``gate=False`` updates the model on every sample. An awake model's
step runs in C when the extension is built (``stalwart.detect._bocpd``, the same arithmetic
as ``BOCPDBank.update``'s numpy reference, which tests compare it with): one call instead of
~20 numpy operations. The pre-filter itself and the segment run in C too (``Gate``,
detect/_native/channels.c; ``PyGate`` is its reference): a sample the model sleeps through
is one C call, and a bank's detectors push in one (``DetectorGroup``).
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata

REPLAY = 36  # samples a woken model is rebuilt from (3 x the default max_lag)

try:  # the BOCPD step in C (detect/_native/bocpd.c); this module's update is the reference
    from stalwart.detect._bocpd import update as _native_update  # type: ignore[import-not-found]
except ImportError:  # no compiler at install: the Python reference runs
    _native_update = None
try:  # (separately: an extension built before ``step`` existed still gives ``update``)
    from stalwart.detect._bocpd import step as _native_step  # type: ignore[import-not-found]
except ImportError:
    _native_step = None
try:  # the pre-filter in C (detect/_native/channels.c); PyGate is the reference
    from stalwart.detect._channels import Gate as _NativeGate  # type: ignore[import-not-found]
    from stalwart.detect._channels import push_many as _push_many  # type: ignore[import-not-found]
except ImportError:
    _NativeGate = _push_many = None


def robust_scale(x: np.ndarray) -> float:
    """1.4826 * MAD: the standard deviation of Gaussian data, unmoved by a few outliers."""
    return float(1.4826 * np.median(np.abs(x - np.median(x))))


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
    size of a real shift); the first of equals; None without candidates."""
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
    ranks = rankdata(np.concatenate([np.asarray(before, float), np.asarray(after, float)]))
    u = float(ranks[n1:].sum()) - n2 * (n2 + 1) / 2.0
    sd = math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12.0)
    return (u - n1 * n2 / 2.0) / sd


def drop_outliers(x: np.ndarray, z: float = 3.0) -> np.ndarray:
    """Samples within ``z`` robust standard deviations of the median."""
    if len(x) < 4:
        return x
    s = robust_scale(x)
    if s <= 0:
        return x
    return x[np.abs(x - np.median(x)) <= z * s]


@functools.lru_cache(maxsize=8)
def _tables(max_run: int, kappa0: float, alpha0: float) -> tuple[np.ndarray, ...]:
    """Per-run-length terms of the Normal-Gamma model, over n = samples absorbed 0..max_run.

    Of the model's parameters only ``mu`` and ``beta`` depend on the data: ``kappa = kappa0 +
    n`` and ``alpha = alpha0 + n/2`` depend only on n, so every term built from them is
    computed once. Student-t predictive: var = beta (kappa+1) / (alpha kappa), hence
    log p(x) = c - 0.5 log(beta) - e log1p(f (x-mu)^2 / beta); f is also beta's update weight
    (beta after x = beta + f (x-mu)^2) and g mu's.
    """
    n = np.arange(max_run + 1, dtype=float)
    kappa = kappa0 + n
    alpha = alpha0 + 0.5 * n
    nu = 2.0 * alpha
    lg = np.array([math.lgamma((v + 1) / 2) - math.lgamma(v / 2) for v in nu])
    c = lg - 0.5 * np.log(nu * math.pi * (kappa + 1.0) / (alpha * kappa))
    e = (nu + 1.0) / 2.0
    f = kappa / (2.0 * (kappa + 1.0))
    g = 1.0 / (kappa + 1.0)
    for t in (c, e, f, g):
        t.flags.writeable = False
    return c, e, f, g


class BOCPDBank:
    """The run-length posteriors of several independent BOCPDs, updated together.

    One row per series (e.g. one per rank's compute channel). ``update`` advances any subset
    of rows by one sample each in a single set of vector operations over (rows x run
    lengths): the cost is that of one series, not one per series. Rows hold hypotheses for
    run lengths 1..n (``n`` per row, at most ``max_run``); the columns past a row's ``n`` hold
    finite placeholders with log posterior -inf, so they carry no mass.
    """

    def __init__(self, hazard: float = 1 / 200, max_run: int = 300, kappa0: float = 0.1,
                 alpha0: float = 5.0) -> None:
        self.hazard = hazard
        self.max_run = max_run
        self.kappa0 = kappa0
        self.alpha0 = alpha0
        self._log_h = math.log(hazard)
        self._log_1mh = math.log1p(-hazard)
        self._c, self._e, self._f, self._g = _tables(max_run, kappa0, alpha0)
        self._em = self._e - 0.5
        # parameters per row, column n = samples absorbed; column 0 is the row's prior. The
        # arrays are views of the first rows of buffers that grow by doubling: a bank of one
        # row per rank is built one row at a time, and growing by one row per call copied the
        # whole bank each time -- O(N^2), 59 s of rank 0's CPU in one step at 10,000 ranks
        # (docs/simulate.md)
        self._cap = 0
        self._bufs: tuple[np.ndarray, ...] = ()
        self._grow(0)

    def _grow(self, rows: int) -> None:
        """Views of ``rows`` rows; the buffers double (copying once) when full."""
        if rows > self._cap or not self._bufs:
            cap = max(8, 2 * self._cap, rows)
            w = self.max_run + 2
            bufs = (np.zeros((cap, w)), np.ones((cap, w)), np.zeros((cap, w)),
                    np.full((cap, self.max_run), -np.inf), np.zeros(cap, dtype=np.int64))
            for new, old in zip(bufs, self._bufs, strict=False):  # none at first
                new[:self._cap] = old[:self._cap]
            self._bufs, self._cap = bufs, cap
        self.mu, self.beta, self.log_beta, self.logpost, self.n = (b[:rows] for b in self._bufs)

    def add_row(self) -> int:
        """A new row (a fresh prior: mu 0, beta 1, no mass); amortised O(1)."""
        row = len(self.n)
        self._grow(row + 1)
        self.mu[row] = 0.0
        self.beta[row] = 1.0
        self.log_beta[row] = 0.0
        self.logpost[row] = -np.inf
        self.n[row] = 0
        return row

    def reset(self, row: int, mu0: float, beta0: float) -> None:
        """Forget row's data: only the prior (mu0, beta0) remains."""
        self.mu[row] = mu0
        self.beta[row] = beta0
        self.log_beta[row] = math.log(beta0)
        self.logpost[row] = -np.inf
        self.n[row] = 0

    native = _native_update is not None  # the C step (the same arithmetic); False: the reference

    def update(self, rows: int | np.ndarray | slice, xs: float | np.ndarray) -> np.ndarray:
        """One sample per row in ``rows``; returns their posteriors (row i: run lengths
        1..n_i in columns 0..n_i-1, zeros after). One row (an int, one float) works on 1-d
        views and costs least; a slice of rows costs less than a list (views, not copies)."""
        if self.native:
            return self._update_native(rows, xs)
        if isinstance(rows, int):
            return self._update_one(rows, float(xs))
        n = self.n[rows]
        w = int(np.max(n)) + 1
        mu, beta = self.mu[rows, :w], self.beta[rows, :w]
        d = (xs[:, None] if np.ndim(xs) else xs) - mu
        d2 = d * d
        # beta after x is beta + f d^2, the same sum the Student-t needs: log p(x) = c +
        # (e - 1/2) log(beta) - e log(beta after x), with log(beta) kept from the last update
        new_beta = beta + self._f[:w] * d2
        log_new_beta = np.log(new_beta)
        lp = self._c[:w] + self._em[:w] * self.log_beta[rows, :w] - self._e[:w] * log_new_beta
        logs = np.empty(lp.shape)
        logs[..., 0] = self._log_h + lp[..., 0]  # a new segment starts with x
        logs[..., 1:] = self.logpost[rows, :w - 1] + (self._log_1mh + lp[..., 1:])  # growth
        logs -= logs.max(axis=-1, keepdims=True)
        post = np.exp(logs)
        total = post.sum(axis=-1, keepdims=True)
        post /= total
        logs -= np.log(total)
        # parameters after x for n = 1..w (the prior stays in column 0)
        self.mu[rows, 1:w + 1] = mu + d * self._g[:w]
        self.beta[rows, 1:w + 1] = new_beta
        self.log_beta[rows, 1:w + 1] = log_new_beta
        if w > self.max_run:
            # Fold the longest run into the cap instead of dropping it: dropping the mass of a
            # long stable segment would make a recent change look certain.
            cap = self.max_run
            post[..., cap - 1] += post[..., cap]
            post, logs = post[..., :cap], logs[..., :cap]
            with np.errstate(divide="ignore"):
                logs[..., cap - 1] = np.log(post[..., cap - 1])
            w = cap
        self.logpost[rows, :w] = logs
        self.n[rows] = np.minimum(n + 1, self.max_run)
        return post

    def _update_native(self, rows: int | np.ndarray | slice,
                       xs: float | np.ndarray) -> np.ndarray:
        """``update`` by the C step: one call instead of ~20 numpy operations."""
        one = isinstance(rows, int)
        if one:
            ids = np.array((rows,), dtype=np.int64)
            x = np.array((xs,), dtype=float)
            w = int(self.n[rows]) + 1
        else:
            if isinstance(rows, slice):
                ids = np.arange(*rows.indices(len(self.n)), dtype=np.int64)
            else:
                ids = np.ascontiguousarray(rows, dtype=np.int64)
            x = np.ascontiguousarray(xs, dtype=float)
            w = int(self.n[ids].max()) + 1
        post = np.empty((ids.size, min(w, self.max_run)))
        assert _native_update is not None
        _native_update(self.mu, self.beta, self.log_beta, self.logpost, self.n, ids, x,
                      self._c, self._em, self._e, self._f, self._g, self._log_h,
                      self._log_1mh, self.max_run, post)
        return post[0] if one else post

    def update_mass(self, row: int, x: float, lag: int) -> float:
        """``update(row, x)``, returning only the posterior mass of run lengths 1..``lag``
        summed in order (what ``ChangeDetector`` asks): in C, one call that builds no array."""
        if self.native and _native_step is not None:
            return _native_step(self.mu, self.beta, self.log_beta, self.logpost, self.n,
                                self._c, self._em, self._e, self._f, self._g, row, x,
                                self._log_h, self._log_1mh, self.max_run, lag)
        return mass(self.update(row, x), lag)

    def _update_one(self, row: int, x: float) -> np.ndarray:
        """``update`` for one row, on 1-d views with scalar reductions: the same arithmetic
        as the general path, about half of its numpy call overhead."""
        n = int(self.n[row])
        w = n + 1
        mu, beta = self.mu[row, :w], self.beta[row, :w]
        d = x - mu
        d2 = d * d
        new_beta = beta + self._f[:w] * d2
        log_new_beta = np.log(new_beta)
        lp = self._c[:w] + self._em[:w] * self.log_beta[row, :w] - self._e[:w] * log_new_beta
        logs = np.empty(w)
        logs[0] = self._log_h + lp[0]
        logs[1:] = self.logpost[row, :n] + (self._log_1mh + lp[1:])
        logs -= logs.max()
        post = np.exp(logs)
        total = post.sum()
        post /= total
        logs -= math.log(total)
        self.mu[row, 1:w + 1] = mu + d * self._g[:w]
        self.beta[row, 1:w + 1] = new_beta
        self.log_beta[row, 1:w + 1] = log_new_beta
        if w > self.max_run:
            cap = self.max_run  # fold the longest run into the cap (see update)
            post[cap - 1] += post[cap]
            post, logs = post[:cap], logs[:cap]
            logs[cap - 1] = math.log(post[cap - 1]) if post[cap - 1] > 0 else -math.inf
            w = cap
        self.logpost[row, :w] = logs
        self.n[row] = w
        return post


class BOCPD:
    """Run-length posterior of Adams & MacKay's BOCPD with a Normal-Gamma model.

    Convention: run length r >= 1 counts the samples of the current segment including the
    newest one; ``posterior[r-1]`` is P(run length = r | data).

    Cost: one update is ~15 vector operations over the run lengths (terms that depend only
    on the run length are tabulated, the posterior is kept in log space). Several BOCPDs that
    share a ``BOCPDBank`` can be updated together (``update_rows``).
    """

    def __init__(self, mu0: float, scale: float, hazard: float = 1 / 200,
                 max_run: int = 300, kappa0: float = 0.1, alpha0: float = 5.0,
                 bank: BOCPDBank | None = None, row: int | None = None) -> None:
        if bank is None:
            bank = BOCPDBank(hazard, max_run, kappa0, alpha0)
        elif (bank.hazard, bank.max_run, bank.kappa0, bank.alpha0) != (
                hazard, max_run, kappa0, alpha0):
            raise ValueError("a BOCPD must have its bank's hazard, max_run and prior")
        self.bank = bank
        self.row = bank.add_row() if row is None else row
        self.hazard = hazard
        self.max_run = max_run
        self.prior = (mu0, kappa0, alpha0, scale * scale * (alpha0 - 1.0))
        bank.reset(self.row, mu0, self.prior[3])
        self.posterior = np.empty(0)

    def update(self, x: float) -> np.ndarray:
        post = self.bank.update(self.row, x)
        self.posterior = post[:self.bank.n[self.row]]
        return self.posterior

    def update_mass(self, x: float, lag: int) -> float:
        """``update(x)``; the posterior mass of run lengths 1..``lag`` (``posterior`` is not
        kept: ``BOCPDBank.update_mass``)."""
        return self.bank.update_mass(self.row, x, lag)


def mass(post: np.ndarray, lag: int) -> float:
    """The posterior mass of run lengths 1..``lag``, summed in order (as the C step does)."""
    return sum(post[:lag].tolist(), 0.0)


def update_rows(models: list[BOCPD], xs: list[float]) -> list[np.ndarray]:
    """``m.update(x)`` for each pair, as one vector update (all models share one bank)."""
    if not models:
        return []
    bank = models[0].bank
    ids = [m.row for m in models]
    rows: np.ndarray | slice = np.array(ids)
    if ids == list(range(ids[0], ids[0] + len(ids))):
        rows = slice(ids[0], ids[0] + len(ids))
    post = bank.update(rows, np.asarray(xs, dtype=float))
    out = []
    for i, m in enumerate(models):
        m.posterior = post[i, :bank.n[m.row]]
        out.append(m.posterior)
    return out


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


NONE, UPDATE, START, WAKE = 0, 1, 2, 3  # what a gate's push asks of its detector


class PyGate:
    """A ``ChangeDetector``'s pre-filter and current segment (the module docstring): the
    Python reference of the C ``Gate`` (detect/_native/channels.c), which tests compare with.

    ``push(key, seconds)`` takes a sample and says what the model needs: NONE (nothing),
    UPDATE (the next value, ``x``), START (a first model from the segment), WAKE (a sleeping
    model rebuilt from the segment without its newest sample, then fed ``x``). ``scale``:
    the series' noise scale in log space, nan until the first model (``model``) is made;
    ``centre``: the model's level. ``x`` is winsorised to +-``clip`` scales of the centre.
    """

    def __init__(self, warmup: int, min_baseline: int, max_lag: int, history: int,
                 min_shift: float, z_sig: float, clip: float, min_scale: float,
                 gate: bool = True) -> None:
        self.warmup, self.min_baseline, self.max_lag = warmup, min_baseline, max_lag
        self.min_shift, self.z_sig, self.clip = min_shift, z_sig, clip
        self.min_scale, self.gate = min_scale, gate
        self.seen = self.pos = self.quiet = self.far = self.slept = 0
        self.model_updates = self.scale_n = 0
        self.pending, self.live, self.model = False, True, False
        self.scale, self.centre, self.x = math.nan, 0.0, 0.0
        self._keys: deque[int] = deque(maxlen=history)
        self._vals: deque[float] = deque(maxlen=history)

    def __len__(self) -> int:
        return len(self._vals)

    def copy(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """The segment's keys and log times, oldest first, into the two arrays."""
        keys[:] = list(self._keys)
        vals[:] = list(self._vals)

    def keep_last(self, run: int) -> None:
        """The newest ``run`` samples become the segment."""
        for q in (self._keys, self._vals):
            tail = list(q)[len(q) - run:]
            q.clear()
            q.extend(tail)

    def push(self, key: int, seconds: float) -> int:
        self.seen += 1
        self.pending = False
        if self.seen <= self.warmup or not seconds > 0 or not math.isfinite(seconds):
            return NONE
        x = math.log(seconds)
        self.pos += 1
        self._keys.append(key)
        self._vals.append(x)
        if not self.model:
            return START if len(self._vals) >= self.min_baseline else NONE
        # The noise scale first comes from min_baseline samples, too few to trust: re-estimate
        # it each time the segment doubles, leaving out the newest samples (maybe a change).
        n = len(self._vals) - self.max_lag
        if n >= 2 * self.scale_n:
            self.scale = max(robust_scale(np.asarray(self._vals)[:n]), self.min_scale)
            self.scale_n = n
        # Winsorise what the model sees to +-clip robust scales around the segment's level:
        # a rare spike must not teach the model a wide variance that would then hide a real
        # shift (a real shift still shows as a run of samples pinned at the clip).
        centre = self.centre
        scale = self.scale if self.scale == self.scale and self.scale else self.min_scale
        code = UPDATE
        if self.gate:
            code = self._wake(x, centre, scale)
            if code == NONE:
                return NONE
        self.model_updates += 1
        c = self.clip * scale
        self.x = min(max(x, centre - c), centre + c)
        return code

    def _wake(self, x: float, centre: float, scale: float) -> int:
        """The pre-filter (module docstring): whether the model must see sample ``x``.

        Called after ``x`` joined the segment. Far = half the least shift verification could
        accept; two far samples of the last three wake a sleeping model (WAKE); ``max_lag``
        quiet samples in a row put it to sleep."""
        need = max(math.log1p(self.min_shift), self.z_sig * 1.25 * scale / math.sqrt(
            self.max_lag))
        far = abs(x - centre) > need
        self.far = ((self.far << 1) | far) & 0b111
        if self.live:
            self.quiet = 0 if far else self.quiet + 1
            if self.quiet > self.max_lag:
                self.live = False  # this sample is quiet too: skip it
                self.slept += 1
                return NONE
            return UPDATE
        if self.far not in (0b011, 0b101, 0b110, 0b111):
            self.slept += 1
            return NONE
        return WAKE


class ChangeDetector:
    """Streaming BOCD+V over (key, iteration time) samples; ``add`` returns a ``Change``."""

    def __init__(self, warmup: int = 10, min_baseline: int = 8, min_shift: float = 0.10,
                 min_spacing: int = 10, threshold: float = 0.9, confirm: int = 3,
                 max_lag: int = 12, hazard: float = 1 / 200, min_scale: float = 0.01,
                 history: int = 400, z_sig: float = 2.5, clip: float = 4.0,
                 bank: BOCPDBank | None = None, gate: bool = True,
                 native: bool | None = None) -> None:
        """``bank``: detectors that share one are updated together by ``add_many``;
        ``gate``: the pre-filter of the module docstring; ``native``: its C version (the
        default when built) or the Python reference."""
        self.bank = bank if bank is not None else BOCPDBank(hazard=hazard)
        self._row: int | None = None  # this detector's row in the bank, once it has one
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
        self.gate = gate
        native = _NativeGate is not None if native is None else native
        cls = _NativeGate if native and _NativeGate is not None else PyGate
        # the pre-filter's state and the current segment (log times, with their keys)
        self._g: PyGate = cls(warmup, min_baseline, max_lag, history, min_shift, z_sig, clip,
                              min_scale, gate)
        self._bocpd: BOCPD | None = None
        self._last_onset_pos: int | None = None  # sample position of last accepted onset
        self._last_up = False  # direction of the last accepted change
        self.changes: list[Change] = []

    # the gate's state, by its detector's names
    @property
    def min_scale(self) -> float:
        return self._g.min_scale

    @min_scale.setter
    def min_scale(self, v: float) -> None:
        self._g.min_scale = v

    @property
    def pending(self) -> bool:
        """True after a sample at which the posterior already put a change within the last
        ``max_lag`` samples but verification has not accepted it (yet): a cheap "something
        may be starting" signal, e.g. to exchange data sooner while it is confirmed."""
        return bool(self._g.pending)

    @property
    def seen(self) -> int:
        return self._g.seen

    @property
    def slept(self) -> int:
        """Samples the model slept through (the pre-filter's saving)."""
        return self._g.slept

    @property
    def model_updates(self) -> int:
        """Samples fed to the model, replays included."""
        return self._g.model_updates

    @property
    def _scale(self) -> float | None:
        """The noise scale in log space, from the first segment (None before it)."""
        s = self._g.scale
        return None if s != s else s

    def _segment(self) -> tuple[np.ndarray, np.ndarray]:
        """The current segment's keys and log times, oldest first (copies)."""
        n = len(self._g)
        keys, vals = np.empty(n, dtype=np.int64), np.empty(n)
        self._g.copy(keys, vals)
        return keys, vals

    def _start_bocpd(self, replay: int | None = None, skip_last: bool = False) -> None:
        """A model for the current segment (without its newest sample: ``skip_last``), fed
        its samples (only the last ``replay``)."""
        g = self._g
        v = self._segment()[1]
        if skip_last:
            v = v[:-1]
        if g.scale != g.scale:
            g.scale = max(robust_scale(v), g.min_scale)
            g.scale_n = len(v)
        scale = g.scale
        centre = float(np.median(v))
        self._bocpd = BOCPD(centre, scale, hazard=self.hazard, bank=self.bank, row=self._row)
        self._row = self._bocpd.row  # a new segment reuses the row
        g.model, g.centre = True, centre
        c = self.clip * scale
        g.live, g.quiet = True, 0
        for x in v if replay is None else v[-replay:]:
            self._bocpd.update_mass(min(max(float(x), centre - c), centre + c), 0)
            g.model_updates += 1

    def _best_split(self, lag: int) -> int:
        """Length of the new regime (1..lag): the ``best_split`` of the segment."""
        v = self._segment()[1]
        i = best_split(v, [len(v) - run for run in range(1, lag + 1) if len(v) - run >= 2])
        return 1 if i is None else len(v) - i

    def add(self, key: int, seconds: float) -> Change | None:
        g = self._g
        code = g.push(key, seconds)
        if code == NONE:
            return None
        x = g.x if code == UPDATE else self._after_push(code)
        if x is None:
            return None
        assert self._row is not None
        lag = min(self.max_lag, len(g) - 1)
        recent = self.bank.update_mass(self._row, x, lag)  # (this detector's BOCPD's row)
        if lag < 1 or recent <= self.threshold:
            return None  # the common case, decided without _verify
        return self._verify(key, lag, recent)

    def _after_push(self, code: int) -> float | None:
        """What a push asked (``PyGate.push``) done; the value the model must see next, or
        None (no model update)."""
        if code == NONE:
            return None
        if code == START:
            self._start_bocpd()
            return None
        if code == WAKE:
            self._start_bocpd(replay=REPLAY, skip_last=True)
        return self._g.x

    def _verify(self, key: int, lag: int, recent: float) -> Change | None:
        """Given the posterior mass of a change within the last ``lag`` samples (``lag`` =
        min(max_lag, segment length - 1)) after the newest sample: the change it verifies."""
        pos = self._g.pos - 1
        if lag < 1:
            return None
        if recent <= self.threshold:
            return None
        self._g.pending = True
        # The posterior says "a change within the last `lag` samples"; where exactly is left to
        # the data: short runs with uncertain variance tend to absorb the first new samples, so
        # the posterior's own argmax places the onset a few samples early.
        run = self._best_split(lag)
        if run < self.confirm:
            return None
        onset_pos = pos - run + 1
        seg_keys, vals = self._segment()
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
        change = Change(onset=int(seg_keys[-run]), decided=key, before=math.exp(lb),
                        after=math.exp(la))
        self._g.pending = False
        self.changes.append(change)
        self._last_onset_pos = onset_pos
        self._last_up = up
        # the new regime becomes the segment; the noise scale learnt at the start is kept
        self._g.keep_last(run)
        self._start_bocpd()
        return change

    @staticmethod
    def add_many(detectors: list[ChangeDetector], key: int,
                 values: list[float]) -> list[Change | None]:
        """``d.add(key, v)`` for each pair, the model updates done as one vector update.

        Same results as calling ``add`` one by one (which it does when they do not all
        share one bank). A caller with the same detectors every step keeps a
        ``DetectorGroup`` instead (the checks here are made once).
        """
        return DetectorGroup(detectors).add(key, values)


class DetectorGroup:
    """Detectors that take one sample each per step (``ChangeDetector.add_many``), with what
    can be checked once checked once: whether they share a bank, and their C gates."""

    def __init__(self, detectors: list[ChangeDetector]) -> None:
        self.detectors = list(detectors)
        self.shared = all(d.bank is self.detectors[0].bank for d in self.detectors)
        self.gates = [d._g for d in self.detectors]
        self.native = _push_many is not None and all(
            type(g) is _NativeGate for g in self.gates)

    def add(self, key: int, values: list[float]) -> list[Change | None]:
        detectors = self.detectors
        if not self.shared:
            return [d.add(key, v) for d, v in zip(detectors, values, strict=True)]
        if self.native:
            assert _push_many is not None
            asked = _push_many(self.gates, key, values)  # usually none
        else:
            asked = [(i, c) for i, c in enumerate(
                g.push(key, v) for g, v in zip(self.gates, values, strict=True)) if c]
        if not asked:
            return [None] * len(detectors)
        xs = [(i, detectors[i]._after_push(code)) for i, code in asked]
        idx = [i for i, x in xs if x is not None]
        posts = update_rows([detectors[i]._bocpd for i in idx],  # type: ignore[misc]
                            [x for _, x in xs if x is not None])
        out: list[Change | None] = [None] * len(detectors)
        for i, post in zip(idx, posts, strict=True):
            d = detectors[i]
            lag = min(d.max_lag, len(d._g) - 1)
            out[i] = d._verify(key, lag, mass(post, lag))
        return out
