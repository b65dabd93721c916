"""Bayesian online change-point detection: the run-length posterior (Adams & MacKay).

Mechanism: BOCPD with a Normal-Gamma conjugate model (Student-t predictive) and a constant
hazard, the run-length posterior truncated to ``max_run`` (the longest run is folded into the
cap, not dropped). ``BOCPDBank`` keeps the posteriors of many series as rows of one set of
arrays and advances any subset of them in one vector update; ``BOCPD`` is one series' view of
a bank row. What a posterior means is left to its caller: ``ChangeDetector`` (changepoint.py)
verifies a change the posterior suggests before reporting it.

Guarantees: memory bounded by rows x ``max_run``; the C step (``stalwart.detect._bocpd``,
detect/_native/bocpd.c) does the same arithmetic as ``BOCPDBank.update``'s numpy reference,
which tests compare it with, and the reference runs where the extension is not built.
Cost: one update is ~15 vector operations over the run lengths for any number of rows (terms
that depend only on the run length are tabulated once, the posterior is kept in log space);
in C one call, and ``update_mass`` builds no array.
"""

from __future__ import annotations

import functools
import math

import numpy as np

try:  # the BOCPD step in C (detect/_native/bocpd.c); this module's update is the reference
    from stalwart.detect._bocpd import update as _native_update  # type: ignore[import-not-found]
except ImportError:  # no compiler at install: the Python reference runs
    _native_update = None
try:  # (separately: an extension built before ``step`` existed still gives ``update``)
    from stalwart.detect._bocpd import step as _native_step  # type: ignore[import-not-found]
except ImportError:
    _native_step = None
try:
    from stalwart.detect._bocpd import replay as _native_replay  # type: ignore[import-not-found]
except ImportError:
    _native_replay = None


# Run lengths a posterior keeps; longer runs are folded into the cap, whose model then rests on
# the newest MAX_RUN samples (a sliding window). Noise model: what the cap changes is how well
# the "no change" hypothesis knows the old level -- from R samples of a series with noise
# scale s, its standard error is s / sqrt(R); at R = 100 that is 0.1 s (the predictive's
# variance +1%; 0.058 s at 300), ~1/9 of the least shift verification can accept
# (changepoint.py: z_sig x 1.25 s / sqrt(max_lag) = 0.9 s). Cost: a step is a log and an exp
# per run length kept -- 100, not 300. Checked on the replay corpus: the same decisions, byte
# for byte, as 300 (tuning part: every cap from 48 up; held-out part: from 80 up).
MAX_RUN = 100


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

    def __init__(self, hazard: float = 1 / 200, max_run: int = MAX_RUN, kappa0: float = 0.1,
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

    def add_rows(self, m: int) -> np.ndarray:
        """``m`` new rows at once (``add_row``'s fresh prior; the buffers grow once)."""
        first = len(self.n)
        self._grow(first + m)
        for a, v in ((self.mu, 0.0), (self.beta, 1.0), (self.log_beta, 0.0),
                     (self.logpost, -np.inf), (self.n, 0)):
            a[first:] = v
        return np.arange(first, first + m)

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

    def replay(self, row: int, xs: np.ndarray, lo: float, hi: float) -> None:
        """``update_mass(row, min(max(x, lo), hi), 0)`` for each x of ``xs`` in order (a new
        model fed its segment): in C one call (``_bocpd.replay``), not one per sample (~7 us
        each on rank 0 after a training step, 36 a wake); ``native = False``: the loop."""
        if self.native and _native_replay is not None:
            _native_replay(self.mu, self.beta, self.log_beta, self.logpost, self.n, self._c,
                           self._em, self._e, self._f, self._g, row,
                           np.ascontiguousarray(xs, dtype=float), lo, hi, self._log_h,
                           self._log_1mh, self.max_run)
            return
        for x in xs:
            self.update_mass(row, min(max(float(x), lo), hi), 0)

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
                 max_run: int | None = None, kappa0: float = 0.1, alpha0: float = 5.0,
                 bank: BOCPDBank | None = None, row: int | None = None) -> None:
        """``max_run``: None takes the bank's (``MAX_RUN`` for a new bank)."""
        if max_run is None:
            max_run = bank.max_run if bank is not None else MAX_RUN
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

    @classmethod
    def many(cls, bank: BOCPDBank, rows: np.ndarray, mu0: np.ndarray, scale: np.ndarray,
             hazard: float) -> list[BOCPD]:
        """``BOCPD(mu0[i], scale[i], hazard, bank=bank, row=rows[i])`` for each i, the rows
        reset as one vector assignment each (the same state)."""
        if hazard != bank.hazard:
            raise ValueError("a BOCPD must have its bank's hazard, max_run and prior")
        beta0 = scale * scale * (bank.alpha0 - 1.0)
        bank.mu[rows] = mu0[:, None]
        bank.beta[rows] = beta0[:, None]
        bank.log_beta[rows] = np.array([math.log(b) for b in beta0.tolist()])[:, None]
        bank.logpost[rows] = -np.inf
        bank.n[rows] = 0
        out = []
        for row, m, b in zip(rows.tolist(), mu0.tolist(), beta0.tolist(), strict=True):
            d = cls.__new__(cls)
            d.bank, d.row, d.hazard, d.max_run = bank, row, hazard, bank.max_run
            d.prior = (m, bank.kappa0, bank.alpha0, b)
            d.posterior = np.empty(0)
            out.append(d)
        return out

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

