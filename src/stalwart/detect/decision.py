"""The detector's decision state machine: samples in, alarms and verdict bookkeeping out.

Torch-free and deterministic: the ``Monitor`` drives it during training (monitor.py), replay
drives it from recorded run directories (stalwart.replay), the simulator from traces. It
does no I/O: typed events (stalwart.events) go to the ``emit`` callable it is given.

Channels (rank 0, the leader, decides for the job):
- the iteration time (rank 0's own step time) through BOCD+V (changepoint.py);
- every rank's compute time relative to the job's median at the same step, through one
  vector BOCD+V bank and a CUSUM bank for small lasting shifts (cusum.py) -- the per-rank
  relative score of NVIDIA's straggler detection.

States of one slowdown: healthy -> an alarm is pending (``pending``) -> it travels to every
rank (``deciding``, the number of rows in flight that carry one) -> every rank validates and
the verdict is applied (``apply_verdict``, verdicts.py): a straggler becomes ``active`` and is
followed on the channel that found it until a recovery alarm (``apply_recovery``,
recovery.py); a verdict naming no rank or link is an unexplained slowdown, logged only if it
lasts ``persist`` samples beyond chance (``LASTING_Z``), otherwise counted as a hiccup. A
slowdown a channel reports while an alarm is pending or deciding waits (up to ``DEFER_MAX``)
and is classified once that decision is made, unless it began before the validation tests
ran (they measured it): the channel has moved its baseline past it and will not report it
again, so a fault that begins while a recovery (whose test looks at the straggler only) or
another alarm is decided is not lost; one that is the decided fault seen again (or began
before the recovery decided) is then dropped as such (one fault, one finding).

Stragglers with no healthy "before" (a rank slow from its first step never changes, so no
channel above fires): every rank's compute over its peers' median goes through a sign test
all the time (``OutlierBank``, outlier.py: at most ``ALPHA_RANK_HOUR`` alarms per healthy
rank-hour), whose alarm (``OUTLIER``) is validated like a change's; and once per job,
``AUDIT_AFTER`` samples or ``AUDIT_S`` seconds after the warm-up, the validation tests run
with no alarm (``AUDIT``: a link slow from the start, or a rank both the audit's sign test
and the compute test name). Their findings are followed for recovery at the peers' level
(``Following.follow_born``, recovery.py).

Recovery at equal load: a compute straggler's recovery alarm is confirmed by the compute test
before it counts (recovery.py).

Layout: ``DecisionCore`` owns the channels, the classification of their changes and the
alarm's journey; it is composed of two parts that own their own state: the followed straggler
and its recovery (``Following``, recovery.py) and the record of validated verdicts
(``VerdictLog``, verdicts.py), each given what it reads by its constructor or per call. The
alarm vocabulary is alarms.py.

Guarantees: bounded memory (``history`` samples); the same inputs give the same alarms and
verdict bookkeeping on every call order the monitor and replay use.
Cost per sample: a few scalar operations while the channels are quiet (the pre-filter,
prefilter.py), one BOCPD step (up to ``max_run`` run lengths: a log and an exp each) per
channel that is awake; batched (``sample_many``, ``relative_rows``: the monitor's checks,
replay's rows) one C call for a run of samples or rows up to the first that needs Python.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from statistics import NormalDist
from typing import Any

import numpy as np

from stalwart.detect.alarms import (
    AUDIT,
    DETECT,
    NONE,
    OUTLIER,
    QUIET,
    RECOVER,
    Alarm,
    IterSample,
    suspect_of,
)
from stalwart.detect.bocpd import BOCPDBank
from stalwart.detect.bocpd import _native_step as _bocpd_step
from stalwart.detect.changepoint import Change, ChangeDetector, DetectorGroup
from stalwart.detect.cusum import REF_RANKS, CusumBank, per_rank_z
from stalwart.detect.evidence import Finding, RankEvidence
from stalwart.detect.onset import BEFORE, ONSET_SLACK
from stalwart.detect.outlier import Outlier, OutlierBank
from stalwart.detect.recovery import Following
from stalwart.detect.verdicts import VerdictLog, still_open
from stalwart.events import Event

try:  # the per-rank channels' rows in one call (detect/_native/channels.c); ``relative`` is
    #   the reference
    from stalwart.detect._channels import Gate as _NativeGate  # type: ignore[import-not-found]
    from stalwart.detect._channels import gate_run as _gate_run  # type: ignore[import-not-found]
    from stalwart.detect._channels import rel_rows as _rel_rows  # type: ignore[import-not-found]
except ImportError:  # no compiler at install (or an extension built before rel_rows)
    _NativeGate = _gate_run = _rel_rows = None

# the audit runs once per job, after the warm-up, at AUDIT_AFTER samples or AUDIT_S seconds
# of iterations (whichever comes first; at least AUDIT_MIN samples): a job slowed by a link
# from its start ran 4 steps a second, and 30 samples came 10 s in
AUDIT_AFTER = 30
AUDIT_S = 2.0
AUDIT_MIN = 5
REL_MIN_SHIFT = 0.15  # the per-rank relative channels' verified shift
DEFER_MAX = 4  # slowdowns held while a decision is under way (bounds the pauses they cost)
VECTOR_RANKS = 64  # from this many ranks ``relative`` works on arrays, not lists
NOISE_RUN_RANKS = 64  # from this many ranks a per-rank slowdown is judged against the
#                      cross-rank noise (_noise_run): q is then resolved to 1/63 or finer
ROWS_KEPT = 32  # steps of every rank's relative compute kept for _noise_run
# a per-rank slowdown's chance, under the cross-rank noise, summed over the ranks: what a
# 4-rank job's per-rank channels allow (per_rank_z: z 2.5 at REF_RANKS ranks)
NOISE_RUN_ALPHA = NormalDist().cdf(-2.5) * REF_RANKS
POOLED_FLOOR = 0.75  # above REF_RANKS a per-rank channel's noise scale is at least this x
#                      the scale pooled over ranks (DecisionCore._pool_noise)


def _median(xs: list[float]) -> float:
    """``statistics.median``, the same arithmetic (the middle value, or the mean of the two
    middle ones) without its generality: once per step on rank 0."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _select_median(a: np.ndarray) -> float:
    """``np.median(a)`` of a non-empty 1-d float64 array without nan or -0.0, the same value
    (the middle value, or (a + b) / 2 of the two middle ones, as np.median's mean of the
    two), by one selection that reorders ``a`` in place: none of np.median's copy, nan check
    and mean (~35 us of a 90 us median at 10,000 values). The caller passes an array it
    owns. (With a -0.0 among equal zeros, which zero is in the middle would be the
    selection's choice; rank 0's inputs have none: positive compute, log ratios -- log
    never returns -0.0 -- and absolute deviations.)"""
    n = a.size
    h = n // 2
    if n % 2:
        a.partition(h)
        return float(a[h])
    a.partition((h - 1, h))
    return float((a[h - 1] + a[h]) / 2)


class DecisionCore:
    """One rank's detection state; rank 0 (``leader``) runs the channels and raises alarms.

    Parts: ``follow`` (the followed straggler, recovery.py) and ``log`` (the verdicts'
    record, verdicts.py); the attributes ``active``, ``findings``, ``verdicts``,
    ``repeats``, ``hiccups``, ``hiccup_log`` and ``unexplained_logged`` read them."""

    def __init__(self, leader: bool, *, warmup: int = 10, persist: int = 20,
                 history: int = 1000, audit: bool = True,
                 emit: Callable[[Event], None] | None = None) -> None:
        self.leader = leader
        # where events go, in order (``add_sink``); the parts call them through ``_emit``
        self._sinks: list[Callable[[Event], None]] = [emit] if emit is not None else []
        self.detector = ChangeDetector(warmup=warmup)
        self.rel_detectors: dict[int, ChangeDetector] = {}
        self._rel_group: DetectorGroup | None = None  # the same, in rank order
        self.cusum: CusumBank | None = None
        # above REF_RANKS ranks: recent cross-rank spreads of log relative compute, the noise
        # floor set from them, and the floors the channels were built with (_pool_noise)
        self._spreads: deque[float] = deque(maxlen=32)
        # from NOISE_RUN_RANKS ranks: the recent steps' relative compute of every rank (key,
        # array), the cross-rank noise a per-rank slowdown is judged against (_noise_run)
        self._rows: deque[tuple[int, np.ndarray]] = deque(maxlen=ROWS_KEPT)
        self._floor: float | None = None
        self._own_floors = (0.0, 0.0)
        self.samples: deque[IterSample] = deque(maxlen=history)
        # the newest samples' seconds, as many as step_seconds reads (kept as they come:
        # read at every batched check, where walking the history cost ~20 us after a step)
        self._recent_s: deque[float] = deque(maxlen=min(32, history))
        self._batch_cache: tuple[Any, ...] | None = None  # _batch_args' arrays
        self._run_cache: tuple[Any, ...] | None = None  # _run_args' arrays
        # _batch_args' critical-count table: (samples seen, outlier bank, table)
        self._crit_memo: tuple[int, Any, np.ndarray] | None = None
        self.pending: Alarm = QUIET
        self.deciding = 0
        self.follow = Following(leader, self._emit)
        self.log = VerdictLog(leader, persist=persist, min_shift=self.detector.min_shift,
                              samples=self.samples, step_seconds=self.step_seconds,
                              emit=self._emit)
        # every rank against its peers all the time (outlier.py), made at the first rows
        self.outliers: OutlierBank | None = None
        self._outlier: Outlier | None = None  # the one whose alarm is on its way
        self.audit_on = audit
        self._warm_s = 0.0  # seconds of iterations since the warm-up (the audit's clock)
        self.audit: dict[str, Any] | None = None  # the audit's outcome, once it ran
        self._seen = 0
        self._first_key: int | None = None
        self._deferred: list[tuple[Change, str]] = []  # slowdowns seen while deciding

    # ---- inputs ---------------------------------------------------------------------------
    def sample(self, s: IterSample) -> None:
        """This rank's iteration; on the leader, the iteration-time channel's next sample."""
        self._note(s)
        if not self.leader:
            return
        if self._deferred and self.pending.action == NONE and not self.deciding:
            self._replay_deferred()
        if (self.follow.recheck_at is not None and self.pending.action == NONE
                and not self.deciding and self.follow.recheck_due(s.key)):
            self.pending = Alarm(RECOVER, s.key, self.follow.recover_level, -1)
        ch = self.detector.add(s.key, s.seconds)
        if ch is not None:
            self.classify(ch)
        if self.log.unexplained is not None:
            self.log.settle(s.key)
        if self._audit_due() and self._quiet():
            # the one look at a job that may be slow from its start (no change to find): the
            # validation tests once, from the first sample on, with no suspect
            self.audit = {"step": s.key}
            self.pending = Alarm(AUDIT, self._first_key, 1.0, -1)

    def _note(self, s: IterSample) -> None:
        """A sample's bookkeeping (every rank): history, counts, the audit's clock."""
        self.samples.append(s)
        self._recent_s.append(s.seconds)
        self._seen += 1
        if self._seen > self.detector.warmup:
            self._warm_s += s.seconds
        if self._first_key is None:
            self._first_key = s.key

    def _note_many(self, batch: list[IterSample]) -> None:
        """``_note`` of each sample of ``batch``, in order (the same state; one call)."""
        if not batch:
            return
        self.samples.extend(batch)
        self._recent_s.extend([s.seconds for s in batch])
        warmup, seen, warm_s = self.detector.warmup, self._seen, self._warm_s
        for s in batch:  # (added one at a time, in order: the same sum as ``_note``'s)
            seen += 1
            if seen > warmup:
                warm_s += s.seconds
        self._seen, self._warm_s = seen, warm_s
        if self._first_key is None:
            self._first_key = batch[0].key

    def sample_many(self, samples: Sequence[IterSample]) -> None:
        """``sample`` of each, in order, with the same effects.

        On the leader, while nothing but the iteration channel can act on a sample (no
        slowdown waiting, no recovery recheck, no unexplained slowdown being followed; with
        the audit still to run, up to the sample that makes it due: ``_before_audit``), a
        run of samples goes through one C call (``gate_run``,
        detect/_native/channels.c: the gate's pushes and the awake model's BOCPD steps),
        which returns at the first sample that leaves work to Python (a model to start, wake
        or verify: ``ChangeDetector.after_push``, then ``classify``). Why: the monitor's
        held steps reach the decision path eight at a time; one at a time each cost rank 0
        ~25 us of CPU after a training step, mostly call overhead. tests/detect/
        test_rel_rows.py checks the equality with ``sample``."""
        i, end = 0, len(samples)
        while i < end:
            args = self._run_args()
            # the audit still to run: the run ends before the sample that makes it due
            last = end if args is None or not self.audit_on or self.audit is not None else (
                self._before_audit(samples, i, end))
            if args is None or last == i:
                self.sample(samples[i])
                i += 1
                continue
            stop, code, lag, mass = _gate_run(self.detector._g, samples, i, last, *args)
            self._note_many(list(itertools.islice(samples, i, min(stop + 1, last))))
            if stop == last:
                i = last
                continue
            s = samples[stop]
            ch = self.detector.after_push(s.key, code, lag, mass)
            if ch is not None:
                self.classify(ch)
            i = stop + 1

    def _before_audit(self, samples: Sequence[IterSample], i: int, end: int) -> int:
        """The first of ``samples[i:end]`` after whose ``_note`` the audit is due
        (``_audit_due``; ``end``: none): the same sums in the same order as ``_note``."""
        seen, warm_s, warmup = self._seen, self._warm_s, self.detector.warmup
        for j in range(i, end):
            seen += 1
            if seen > warmup:
                warm_s += samples[j].seconds
            after = seen - warmup
            if after >= AUDIT_MIN and (after >= AUDIT_AFTER or warm_s >= AUDIT_S):
                return j
        return end

    def _run_args(self) -> tuple[Any, ...] | None:
        """``gate_run``'s arguments after the samples, or None where ``sample`` must run
        (``sample_many``; before the audit a run also ends where ``_before_audit`` says)."""
        d = self.detector
        if (_gate_run is None or not self.leader or self._deferred
                or self.follow.recheck_at is not None or self.log.unexplained is not None
                or type(d._g) is not _NativeGate):
            return None
        bank = d.bank
        if not (bank.native and _bocpd_step is not None):
            return None
        # the bank's arrays, taken again when its views changed (all five rebind together,
        # ``BOCPDBank._grow``; the tables never do)
        arrays = self._run_cache
        if arrays is None or arrays[0] is not bank.mu:
            arrays = self._run_cache = (
                bank.mu, (bank.mu, bank.beta, bank.log_beta, bank.logpost, bank.n, bank._c,
                          bank._em, bank._e, bank._f, bank._g),
                (bank._log_h, bank._log_1mh, bank.max_run))
        return ((-1 if d._row is None else d._row, d.max_lag, d.threshold), arrays[1],
                arrays[2])

    @property
    def first_key(self) -> int | None:
        """The key of the first sample this rank's monitor took (None before it)."""
        return self._first_key

    def _audit_due(self) -> bool:
        after = self._seen - self.detector.warmup
        return self.audit_on and self.audit is None and after >= AUDIT_MIN and (
            after >= AUDIT_AFTER or self._warm_s >= AUDIT_S)

    def _quiet(self) -> bool:
        """Leader: nothing under way, no straggler followed, peers known, and the iteration
        channel's posterior not on a change it has not verified yet (the audit looks for
        ranks slow all along and judges no change: run while a change is being confirmed, it
        delays that change's alarm by a whole validation -- seen: 12 steps under batched
        exchanges, a 6x rank found 26 steps after its onset). The flag holds for one sample
        at a time, so the audit waits only while a change is forming. The per-rank channels
        are asked below ``VECTOR_RANKS`` ranks only (a 2-rank job's 6x rank formed on its own
        channel first): among thousands some posterior is nearly always pending (the audit
        would wait for ever), and asking costs a call per rank per step."""
        forming = self.detector.pending or (len(self.rel_detectors) < VECTOR_RANKS and any(
            d.pending for d in self.rel_detectors.values()))
        return (self.pending.action == NONE and not self.deciding and self.follow.active is None
                and self.outliers is not None and not forming)

    def relative(self, key: int, comps: list[float] | np.ndarray) -> None:
        """Leader: every rank's compute time at step ``key`` (rank order). From
        ``VECTOR_RANKS`` ranks on, the checks, the median and the ratios are one vector
        operation each (at 10,000 ranks the Python loops over the list cost ~2 ms a step);
        below, plain Python (numpy's per-call overhead exceeds the work at a few ranks). The
        same values either way (tests/detect/test_relative_vector.py)."""
        if len(comps) >= VECTOR_RANKS:
            arr = np.asarray(comps, dtype=float)
            if not (arr.min() > 0.0 and arr.max() < math.inf):  # (a nan fails: min, max)
                return
            ratios = arr / _select_median(arr.copy())  # (np.median: _median's arithmetic)
            rel: list[float] | np.ndarray = ratios
            rel_list = ratios.tolist()
            comps = arr
        else:
            for c in comps:
                if not 0.0 < c < math.inf:  # (nan fails too)
                    return
            med = _median(list(comps))
            rel = rel_list = [c / med for c in comps]
        if len(comps) >= NOISE_RUN_RANKS:
            self._rows.append((key, np.asarray(rel, dtype=float)))
        group = self._rel_dets(len(comps))
        if len(comps) > REF_RANKS:
            self._pool_noise(group.detectors, rel)
        self._classify_ranks(group.add(key, rel_list))
        if self.cusum is None or self.cusum.n != len(comps):
            self.cusum = CusumBank(len(comps), warmup=self.detector.warmup)
        # small lasting shifts (a 1.3x throttle) that BOCD+V's verification lets pass; the
        # validation tests must still confirm the rank (cusum.py)
        self._classify_ranks(self.cusum.add(key, rel))
        if self.outliers is None or self.outliers.n != len(comps):
            self.outliers = OutlierBank(len(comps), warmup=self.detector.warmup)
        # a rank slower than its peers all along, which no change point shows (outlier.py)
        for o in self.outliers.add(key, comps, self.step_seconds):
            self._on_outlier(o)

    def relative_rows(self, rows: Sequence[tuple[int, list[float] | np.ndarray]]) -> None:
        """``relative(key, comps)`` for each row, in order, with the same effects.

        Up to ``REF_RANKS`` ranks, once the per-rank channels exist, a run of rows of the
        same size goes through one C call (``rel_rows``, detect/_native/channels.c) that does
        each row's median and ratios, gate pushes, BOCPD steps of the awake channels, CUSUM
        and outlier steps, and returns at the first row that leaves work to Python -- a model
        to start, wake or verify, a CUSUM fit, alarm or refit, an outlier test (about one row
        in five) -- whose rest runs here as in ``relative``. Why: on rank 0 after a training
        step each of ``relative``'s three C steps cost ~40 us of CPU in call overhead alone
        (cold caches), ~120 us a row; a batched check of eight rows paid it eight times.
        Otherwise (more ranks: the pooled noise floor; no C extension) ``relative`` per row.
        tests/detect/test_rel_rows.py checks the equality on random streams."""
        i, end = 0, len(rows)
        while i < end:
            n = len(rows[i][1])
            args = self._batch_args(n)
            if args is None:
                self.relative(*rows[i])
                i += 1
                continue
            j = i + 1
            while j < end and len(rows[j][1]) == n:
                j += 1
            assert _rel_rows is not None and self.cusum is not None
            assert self.outliers is not None and self._rel_group is not None
            cb, ob = self.cusum, self.outliers
            stop, valid, osteps, asked, fits, alarms, test = _rel_rows(rows, i, j, *args)
            cb._pos += valid
            ob.seen += valid
            ob._pos += osteps
            if stop == j:
                i = j
                continue
            # the rest of row ``stop``, in relative's order
            key = int(rows[stop][0])
            if asked:
                self._classify_ranks(self._rel_group.row_steps(key, asked))
            if fits or alarms:
                self._classify_ranks(cb.after_step(key, fits, alarms, cb._live))
            if test:
                for o in ob._test(key, self.step_seconds()):
                    self._on_outlier(o)
            i = stop + 1

    def _batch_args(self, n: int) -> tuple[Any, ...] | None:
        """``rel_rows``' arguments after the rows for rows of ``n`` ranks, or None where the
        batched path does not apply (``relative_rows``): the channels of ``n`` ranks must
        exist (their first row goes through ``relative``, which makes them) and run in C."""
        group, cb, ob = self._rel_group, self.cusum, self.outliers
        if (_rel_rows is None or not 2 <= n <= REF_RANKS or group is None
                or len(group.detectors) != n or cb is None or cb.n != n or ob is None
                or ob.n != n or not (group.native and group.shared and cb.native and ob.native)):
            return None
        dets = group.detectors
        bank = dets[0].bank
        if not (bank.native and _bocpd_step is not None):
            return None
        cache = self._batch_cache
        # the arrays, taken again when the channels or the bank's buffers changed (a bank
        # grows by new views of all its arrays at once; the C steps never rebind an array,
        # the Python references rebind these three)
        if cache is None or cache[0] is not group or cache[1] is not bank.mu or (
                cache[2] is not cb or cache[3] is not ob or -1 in cache[5]
                or cache[9][6] is not cb.s or cache[9][7] is not cb.zero_key
                or cache[10][5] is not ob.filled):
            cache = self._batch_cache = (
                group, bank.mu, cb, ob, tuple(group.gates),
                tuple(-1 if d._row is None else d._row for d in dets),
                tuple((-1 if d._row is None else d._row, d.max_lag, d.threshold)
                      for d in dets),
                (bank.mu, bank.beta, bank.log_beta, bank.logpost, bank.n, bank._c, bank._em,
                 bank._e, bank._f, bank._g), (bank._log_h, bank._log_1mh, bank.max_run),
                (cb._keys, cb._xs, cb.seen, cb.start_key, cb.mu0, cb.sigma, cb.s, cb.zero_key,
                 cb.backoff, cb._live),
                (ob._over, ob._logrel, ob._excess, ob._keys, ob.count, ob.filled, ob._whole,
                 ob.line))
        # the critical counts at the recent step time: that time changes only with a new
        # sample (``_recent_s``), so the table is looked up again only then
        crit = self._crit_memo
        if crit is None or crit[0] != self._seen or crit[1] is not ob:
            crit = self._crit_memo = (self._seen, ob,
                                      ob.crit_table(ob.test_level(self.step_seconds())))
        return (cache[4], cache[6], cache[7], cache[8], cache[9],
                (cb._pos, cb.REFIT_EVERY, cb.LAG, cb.warmup, cb.learn, cb.k, cb.clip, cb.h,
                 cb._log_n, cb.min_sigma),
                cache[10], (ob.seen, ob.warmup, ob._pos, ob.stride, ob.min_window), crit[2])

    def _rel_dets(self, n: int) -> DetectorGroup:
        """The per-rank relative-compute channels of ranks 0..n-1 (made at the first call)."""
        if not self.rel_detectors:
            # one bank: every rank's channel advances in one vector update per step
            bank = BOCPDBank(hazard=self.detector.hazard)
            z = per_rank_z(n)  # as strict per rank as the job size needs
            self.rel_detectors = {r: ChangeDetector(
                warmup=self.detector.warmup, min_shift=REL_MIN_SHIFT, z_sig=z, bank=bank)
                for r in range(n)}
            self._rel_group = DetectorGroup([self.rel_detectors[r] for r in range(n)])
        if self._rel_group is not None and len(self._rel_group.detectors) == n:
            return self._rel_group
        return DetectorGroup([self.rel_detectors[r] for r in range(n)])

    def _classify_ranks(self, changes: list[Change | None]) -> None:
        """Each rank's change (rank order) on its own channel. (Whether there is one:
        ``count(None)``, a pointer comparison per rank -- ``any`` asks each element's truth,
        ~90 us over 10,000 ranks, twice a step.)"""
        if changes.count(None) != len(changes):
            for r, ch in enumerate(changes):
                if ch is not None:
                    self.classify(ch, f"rank{r}")

    def step_seconds(self) -> float:
        """The job's recent step time (median of the last 32 iteration samples)."""
        xs = list(self._recent_s)  # (the last 32 samples' seconds)
        return _median(xs) if xs else 1.0

    def _on_outlier(self, o: Outlier) -> None:
        """An outlier alarm, priced from the peers: the job's step time over its step time
        without the rank's excess compute (every rank waits for the slowest); its onset is
        the monitor's first sample while the rank's whole history is in question (its first
        window), else its window's first sample."""
        t = self.step_seconds()
        severity = t / max(t - max(o.excess, 0.0), 0.1 * t)
        onset = self._first_key if o.whole and self._first_key is not None else o.onset
        before = self.pending
        self.classify(Change(onset, o.key, 1.0, o.level), f"rank{o.rank}", OUTLIER, severity)
        if self.pending is not before and self.pending.action == OUTLIER:
            self._outlier = o

    def _pool_noise(self, dets: list[ChangeDetector], rel: list[float]) -> None:
        """A floor under every per-rank channel's noise scale: ``POOLED_FLOOR`` x the median
        of recent cross-rank spreads (1.4826 MAD of log relative compute over all ranks).

        Why: each channel learns its noise from its own first 8 samples (BOCD+V) or 18
        (CUSUM), an estimate that is often far too small; among thousands of ranks the
        smallest ones are, and those channels alarm on noise. In one step every rank gives a
        sample of the same noise, so at scale the pooled spread is known well after a few
        steps. Up to REF_RANKS ranks (the size the thresholds were tuned on) nothing changes.
        Cost: two selections over the ranks per step (in place, on the one array this makes),
        an O(N) loop when the floor moves by > 20%."""
        x = np.log(np.asarray(rel))
        # the median's selection reorders x; the deviations from it do not depend on order
        np.abs(np.subtract(x, _select_median(x), out=x), out=x)
        self._spreads.append(float(1.4826 * _select_median(x)))
        if len(self._spreads) < 4 or self.cusum is None:
            return
        floor = POOLED_FLOOR * statistics.median(self._spreads)
        if self._floor is not None and abs(floor / self._floor - 1.0) <= 0.2:
            return
        if self._floor is None:  # the floors the channels were built with
            self._own_floors = (dets[0].min_scale, self.cusum.min_sigma)
        self._floor = floor
        for d in dets:
            d.min_scale = max(self._own_floors[0], floor)
        self.cusum.min_sigma = max(self._own_floors[1], floor)

    def _replay_deferred(self) -> None:
        """Leader, no decision under way: classify the slowdowns that waited for the last one
        (the first that raises an alarm makes the rest wait again)."""
        waiting, self._deferred = self._deferred, []
        for ch, channel in waiting:
            self.classify(ch, channel)

    # ---- the alarm's journey ----------------------------------------------------------------
    def take_pending(self, travels: bool = True) -> Alarm:
        """Leader: the alarm to send now (QUIET if none); one that ``travels`` to the other
        ranks counts as deciding until it is read back."""
        alarm, self.pending = self.pending, QUIET
        if alarm.action != NONE and travels:
            self.deciding += 1
        return alarm

    def alarm_read(self) -> None:
        """Leader: a row carrying an alarm was read back (its verdict follows at once)."""
        self.deciding -= 1

    def alert(self) -> bool:
        """Whether a decision is under way or a channel's posterior has fired: the exchange
        should run every step."""
        return self.pending.action != NONE or self.deciding > 0 or any(
            d.pending for d in (self.detector, *self.rel_detectors.values()))

    def classify(self, ch: Change, channel: str = "iteration", action: int = DETECT,
                 severity: float | None = None) -> None:
        """A change (or an outlier: ``action`` OUTLIER, ``severity`` priced from the peers)
        becomes the pending alarm, a recovery, or nothing (see the module docstring)."""
        if self._back_among_peers(ch, channel, action) or self._noise_run(ch, channel, action):
            return
        if self.pending.action != NONE or self.deciding:
            # a decision is already on its way: a slowdown waits for it (module docstring)
            if action == DETECT and ch.ratio > 1.0 and len(self._deferred) < DEFER_MAX:
                self._deferred.append((ch, channel))
            return
        sev = ch.ratio if severity is None else severity
        follow, active = self.follow, self.follow.active
        if active is None:
            if ch.ratio > 1.0:
                follow.watch(channel, ch.before)
                self.pending = Alarm(action, ch.onset, sev, suspect_of(channel))
            # a speed-up while healthy just moves the baseline
            return
        if ch.ratio > 1.0 and (ch.onset <= active.step or (
                active.kind == "compute" and suspect_of(channel) in active.ranks)):
            # the slowdown already found, seen again (the iteration time and the culprit's
            # own compute move together; BOCD+V and CUSUM share a rank's channel): one fault,
            # one finding
            return
        if channel != follow.channel:
            if ch.ratio > 1.0:  # another straggler while one is in progress
                # followed on its channel only if the tests confirm it is a new one
                follow.propose(channel, ch.before)
                self.pending = Alarm(action, ch.onset, sev, suspect_of(channel))
            return  # recoveries are followed on the channel that found the slowdown
        if ch.ratio > 1.0:
            self.pending = Alarm(action, ch.onset, ch.after / (follow.healthy or ch.before)
                                 if severity is None else severity, suspect_of(channel))
        elif (level := follow.recovery_level(ch.after, self.detector.min_shift)) is not None:
            self.pending = Alarm(RECOVER, ch.onset, level, -1)

    def _back_among_peers(self, ch: Change, channel: str, action: int) -> bool:
        """Whether a per-rank channel's slowdown only brings the rank back among its peers,
        so no alarm is due: it starts below the peers' level (1.0: a per-rank channel reads
        the rank's compute over the peers' median) and ends at most the channel's verified
        shift (``REL_MIN_SHIFT``) above it -- half of it with two ranks, where the median
        is the mean of the two and a rank's slowdown by x reads 2x / (1 + x). Such a rank
        does not stall the job more than its peers' noise does.

        The noise model: a per-rank channel verifies a change at ``per_rank_z`` standard
        errors, which bounds how often a channel wrongly moves its level, not how often a
        level learned or moved low by chance is followed by the rank's return to its
        peers; among thousands of ranks under heavy-tailed compute noise such dips are
        many, and each return was verified as a slowdown (most of the simulator's
        validation pauses at 10,000 ranks). What it costs: a throttle that leaves a rank
        less than the verified shift slower than its peers is not alarmed by its own
        channel. The iteration channel and outlier alarms are not concerned."""
        if action != DETECT or suspect_of(channel) < 0 or not 1.0 < ch.ratio:
            return False
        shift = REL_MIN_SHIFT / 2 if len(self.rel_detectors) == 2 else REL_MIN_SHIFT
        return ch.before < 1.0 and ch.after <= 1.0 + shift

    def _noise_run(self, ch: Change, channel: str, action: int) -> bool:
        """From ``NOISE_RUN_RANKS`` ranks: whether a per-rank slowdown is as likely under the
        job's own cross-rank noise as the per-rank channels allow a false alarm. Its steps
        from the onset to the decision each read q = the share of the other ranks whose
        relative compute lay beyond the change's midpoint (sqrt(before x after)) at that
        step; under noise that is independent from step to step the rank's run has chance
        p = the product of the q's, and among n ranks n x p must stay under
        ``NOISE_RUN_ALPHA`` (the job-wide chance a 4-rank job's channels have at z 2.5:
        ``per_rank_z``'s budget). Why: ``per_rank_z`` scales a normal model of each series'
        MAD with n, which the measured heavy-tailed compute noise outruns -- at 10,000
        ranks 3-4 samples of ~1.18x are verified every few hundred steps; a real straggler
        has no other rank beyond its midpoint (p ~ 0) and passes at once. A host's 8 ranks
        slowed together keep q ~ 7 / n. Cost: O(n) per step of the run, only for a per-rank
        slowdown alarm (a few a day); nothing below NOISE_RUN_RANKS ranks."""
        if action != DETECT or not self._rows or ch.ratio <= 1.0:
            return False
        r = suspect_of(channel)
        n = len(self._rows[-1][1])
        if r < 0 or r >= n or n < NOISE_RUN_RANKS:
            return False
        mid = math.sqrt(ch.before * ch.after)
        p, steps = 1.0, 0
        for key, rel in self._rows:
            if ch.onset <= key <= ch.decided and len(rel) == n:
                beyond = int(np.count_nonzero(rel > mid)) - int(rel[r] > mid)
                p *= beyond / (n - 1)
                steps += 1
                if p == 0.0:
                    return False
        return steps > 0 and p * n > NOISE_RUN_ALPHA

    # ---- the evidence the validation reads; events out -------------------------------------
    def evidence(self, rank: int, onset: int, decided: int) -> RankEvidence:
        """This rank's training-time profile around a detected onset (localize.py)."""
        before = [s for s in self.samples if onset - BEFORE <= s.key < onset]
        after = [s for s in self.samples if onset <= s.key <= decided]

        def med(xs: list[IterSample], attr: str) -> float | None:
            vals = [getattr(s, attr) for s in xs if getattr(s, attr) is not None]
            return statistics.median(vals) if vals else None

        # what culprit_onset splits: the window it searches and the baseline before it
        window = [s for s in self.samples if onset - ONSET_SLACK - BEFORE <= s.key <= decided]
        recent = [(s.key, s.compute) for s in window if s.compute]
        return RankEvidence(rank, med(before, "compute"), med(after, "compute"),
                            med(before, "comm"), med(after, "comm"), recent=recent,
                            steps=[(s.key, s.seconds) for s in window])

    def add_sink(self, sink: Callable[[Event], None]) -> None:
        """``sink`` receives every event emitted from now on, before the sinks given
        earlier (the constructor's ``emit``, then those added before it, last). Cost: one
        call per event and sink."""
        self._sinks.insert(0, sink)

    def _emit(self, ev: Event) -> None:
        """``ev`` to every sink (``add_sink``), in order; none: dropped."""
        for sink in self._sinks:
            sink(ev)

    # ---- verdicts and recovery: the parts, with what they need ------------------------------
    def apply_verdict(self, finding: Finding, suspect: int | None, pause: float = 0.0,
                      action: int = DETECT) -> None:
        """Every rank: the validated verdict on an alarm (the same on every rank);
        ``action``: the alarm's (DETECT, OUTLIER or AUDIT). The slowdowns held while it was
        decided that it explains are dropped (``still_open``), the audit's outcome kept, and
        the verdict recorded (``VerdictLog.apply``)."""
        self._deferred = [(c, n) for c, n in self._deferred
                          if still_open(c, n, finding, action)]
        outlier, self._outlier = self._outlier, None
        if self.leader and action == OUTLIER and suspect is not None and self.outliers and not (
                finding.kind == "compute" and finding.ranks == [suspect]):
            self.outliers.unconfirmed(suspect)  # not paused for again at that level
        if action == AUDIT:
            self.audit = {"step": finding.step, "kind": finding.kind,
                          "evidence": finding.evidence}
        self.log.apply(finding, suspect, pause, action, follow=self.follow, outlier=outlier,
                       cusum=self.cusum)

    def needs_recovery_test(self) -> bool:
        """Whether a recovery alarm must be confirmed by the compute test
        (``Following.needs_test``)."""
        return self.follow.needs_test()

    def request_recovery_test(self, key: int) -> bool:
        """Leader: the mitigation policy sees the followed compute straggler healthy on the
        reduced share its plan gave it, and asks for the compute test (a recovery alarm now).
        Ignored while a decision is under way or a rejected recovery's wait
        (``RECHECK``..``RECHECK_MAX``, recovery.py) runs: the tests' pauses stay bounded."""
        if not self.follow.may_request() or self.pending.action != NONE or self.deciding:
            return False
        self.pending = Alarm(RECOVER, key, self.follow.recover_level, -1)
        return True

    def recovery_threshold(self) -> float:
        """The compute-test ratio below which the straggler counts as recovered
        (``Following.threshold``)."""
        return self.follow.threshold()

    def recovery_test(self, ratio: float | None, decided: int) -> bool:
        """Every rank: the compute test's verdict on a recovery alarm (``Following.test``)."""
        return self.follow.test(ratio, decided)

    def apply_recovery(self, onset: int, decided: int, level: float,
                       test_ratio: float | None = None) -> None:
        """Every rank: the followed straggler's channel is back to its healthy level
        (``Following.recovered``). A slowdown that waited and began before this recovery
        was part of the straggler's episode (another channel seeing it late): dropped."""
        self.follow.recovered(onset, decided, level, test_ratio)
        self._deferred = [(c, n) for c, n in self._deferred if c.onset > onset]

    def close(self) -> None:
        """The run ended: settle an unexplained slowdown still waiting to prove it lasts."""
        self.log.close()

    @property
    def active(self) -> Finding | None:
        """The straggler being followed (``Following.active``)."""
        return self.follow.active

    @property
    def findings(self) -> list[Finding]:
        """Every new verdict, in order (``VerdictLog.findings``)."""
        return self.log.findings

    @property
    def verdicts(self) -> int:
        """Validated alarms so far, each one a validation pause."""
        return self.log.count

    @property
    def repeats(self) -> int:
        """Verdicts that named the followed straggler again (not logged)."""
        return self.log.repeats

    @property
    def hiccups(self) -> int:
        """Slowdowns counted, not logged (unconfirmed, or unexplained and not lasting)."""
        return self.log.hiccups

    @property
    def hiccup_log(self) -> deque[dict[str, Any]]:
        """The last 16 hiccups: why, and the verdict's step, onset, severity, evidence."""
        return self.log.hiccup_log

    @property
    def unexplained_logged(self) -> int:
        """Unexplained slowdowns that lasted and were logged."""
        return self.log.unexplained_logged
