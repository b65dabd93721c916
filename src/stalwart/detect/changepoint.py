"""Change-point detection with verification ("BOCD+V", FALCON/Greyhound) on iteration times.

Mechanism: BOCPD (bocpd.py) on log iteration times proposes a change when its posterior puts
one within the last ``max_lag`` samples; FALCON accepts a change point only if the level
before and after differs by >= 10%, after dropping |z| > 3 outliers, with change points >= 10
iterations apart; that verification is what took their false-positive rate from 18-34% to 0%.
A pre-filter (prefilter.py) decides which samples the model must see at all.

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

Cost: a sample the model sleeps through is one pre-filter call (in C when
detect/_native/channels.c is built); a woken model is rebuilt from the segment's last
``REPLAY`` samples and then costs one BOCPD step per sample (one C call when
``stalwart.detect._bocpd`` is built, instead of ~20 numpy operations). A bank's detectors
push and update in one call each (``DetectorGroup``); ``gate=False`` updates the model on
every sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stalwart.detect.bocpd import BOCPD, BOCPDBank
from stalwart.detect.prefilter import NONE, START, UPDATE, WAKE, PyGate
from stalwart.detect.robust import best_split, drop_outliers, median, robust_scale

REPLAY = 36  # samples a woken model is rebuilt from (3 x the default max_lag)
START_MANY = 16  # first models started in one step from which they start as arrays
ROW_STEPS = 8  # up to this many models to update in one step: one C step each, not a vector
VERIFY = 4  # a batched row's model stepped in C, its mass past the threshold (``row_steps``)

try:  # the pre-filter in C (detect/_native/channels.c); PyGate is the reference
    from stalwart.detect._channels import Gate as _NativeGate  # type: ignore[import-not-found]
    from stalwart.detect._channels import push_many as _push_many  # type: ignore[import-not-found]
except ImportError:
    _NativeGate = _push_many = None


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
                 history: int = 400, z_sig: float = 2.5, clip: float = 4.0,
                 bank: BOCPDBank | None = None, gate: bool = True,
                 native: bool | None = None) -> None:
        """``bank``: detectors that share one are updated together by ``add_many``;
        ``gate``: the pre-filter (prefilter.py); ``native``: its C version (the
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
        centre = median(v)
        self._bocpd = BOCPD(centre, scale, hazard=self.hazard, bank=self.bank, row=self._row)
        self._row = self._bocpd.row  # a new segment reuses the row
        g.model, g.centre = True, centre
        c = self.clip * scale
        g.live, g.quiet = True, 0
        xs = v if replay is None else v[-replay:]
        self.bank.replay(self._row, xs, centre - c, centre + c)
        g.model_updates += len(xs)

    def _best_split(self, lag: int, v: np.ndarray | None = None) -> int:
        """Length of the new regime (1..lag): the ``best_split`` of the segment (``v``: its
        log times, ``_segment()[1]``, when the caller has them)."""
        if v is None:
            v = self._segment()[1]
        i = best_split(v, [len(v) - run for run in range(1, lag + 1) if len(v) - run >= 2])
        return 1 if i is None else len(v) - i

    def add(self, key: int, seconds: float) -> Change | None:
        g = self._g
        code = g.push(key, seconds)
        if code == NONE:
            return None
        return self.after_push(key, code)

    def after_push(self, key: int, code: int, lag: int = 0, mass: float = 0.0) -> Change | None:
        """The rest of ``add`` after its gate's push asked ``code`` (not NONE); VERIFY: the
        model was stepped already (the batched samples' path, ``gate_run`` in channels.c),
        with ``lag`` and the posterior ``mass`` past the threshold."""
        if code == VERIFY:
            return self._verify(key, lag, mass)
        g = self._g
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
        seg_keys, vals = self._segment()
        run = self._best_split(lag, vals)
        if run < self.confirm:
            return None
        onset_pos = pos - run + 1
        before = drop_outliers(vals[:-run])
        after = vals[-run:]
        if len(before) < 2:
            return None
        # (np.mean's arithmetic: numpy's sum, then one division, without its wrappers)
        lb, la = float(np.add.reduce(before)) / len(before), median(after)
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
        far = np.count_nonzero(after > mid) if la > lb else np.count_nonzero(after < mid)
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


def _start_many(dets: list[ChangeDetector]) -> None:
    """``d._start_bocpd()`` for each detector (first models, sharing one bank), the
    arithmetic as arrays: the segments' noise scales and medians as one reduction per
    segment length, every model's replay as one bank update per sample. The same state as
    one start at a time (tests/detect/test_start_many.py). Why: every rank's channel of a
    job starts at the same step; one at a time that step cost rank 0 ~0.6 ms per rank (6 s
    at 10,000 ranks, again after every restart)."""
    new = [d for d in dets if d._row is None]
    if new:  # bank rows in the detectors' order, as one at a time
        for d, row in zip(new, new[0].bank.add_rows(len(new)).tolist(), strict=True):
            d._row = row
    by_len: dict[tuple[int, float], list[ChangeDetector]] = {}
    for d in dets:
        by_len.setdefault((len(d._g), d.hazard), []).append(d)
    for (size, _), group in by_len.items():
        m = len(group)
        keys, vals = np.empty(size, dtype=np.int64), np.empty((m, size))
        for i, d in enumerate(group):
            d._g.copy(keys, vals[i])
        centre = np.median(vals, axis=1)
        spread = 1.4826 * np.median(np.abs(vals - centre[:, None]), axis=1)  # robust_scale
        scales = np.empty(m)
        for i, d in enumerate(group):
            g = d._g
            if g.scale != g.scale:
                g.scale = max(float(spread[i]), g.min_scale)
                g.scale_n = size
            scales[i] = g.scale
        bank = group[0].bank
        rows = np.fromiter((d._row for d in group), np.int64, m)
        models = BOCPD.many(bank, rows, centre, scales, group[0].hazard)
        for d, model, level in zip(group, models, centre.tolist(), strict=True):
            g = d._g
            d._bocpd = model
            g.model, g.centre = True, level
            g.live, g.quiet = True, 0
            g.model_updates += size
        c = np.asarray([d.clip for d in group]) * scales
        xs = np.minimum(np.maximum(vals, (centre - c)[:, None]), (centre + c)[:, None])
        for j in range(size):
            bank.update(rows, np.ascontiguousarray(xs[:, j]))


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
        starts = [i for i, code in asked if code == START]
        if len(starts) >= START_MANY:  # (a START asks no model update: nothing else changes)
            _start_many([detectors[i] for i in starts])
            asked = [(i, code) for i, code in asked if code != START]
        if len(asked) <= ROW_STEPS:
            # few models to update: the C step per row (``add``'s path) costs less than
            # building one vector update; the same arithmetic (the C step sums in order)
            return self.row_steps(key, asked)
        out: list[Change | None] = [None] * len(detectors)
        idx, xs = [], []
        for i, code in asked:
            x = detectors[i]._after_push(code)
            if x is not None:
                idx.append(i)
                xs.append(x)
        if not idx:
            return out
        dets = [detectors[i] for i in idx]
        bank = dets[0].bank
        ids = [d._row for d in dets]
        rows: np.ndarray | slice = np.array(ids)
        if ids == list(range(ids[0], ids[0] + len(ids))):
            rows = slice(ids[0], ids[0] + len(ids))
        post = bank.update(rows, np.asarray(xs, dtype=float))  # (update_rows' one update)
        m = len(dets)
        lags = np.fromiter((min(d.max_lag, len(d._g) - 1) for d in dets), np.int64, m)
        thr = np.fromiter((d.threshold for d in dets), float, m)
        # ``mass(posterior, lag)`` of every model at once: the first min(lag, n) run lengths
        # summed in order -- add.accumulate is sequential, as ``mass``'s sum over the list
        take = np.minimum(lags, bank.n[np.asarray(ids)])
        ok = np.flatnonzero(take >= 1)
        masses = np.zeros(m)
        masses[ok] = np.add.accumulate(post, axis=1)[ok, take[ok] - 1]
        # only a model past its threshold is verified (``_verify`` returns None below it,
        # changing nothing): ~100 of 10,000 ranks' models awake a step, one or none past it
        for j in np.flatnonzero((lags >= 1) & (masses > thr)).tolist():
            out[idx[j]] = dets[j]._verify(key, int(lags[j]), float(masses[j]))
        return out

    def row_steps(self, key: int, asked: Sequence[tuple[int, ...]]) -> list[Change | None]:
        """What the pushes ``asked`` for, one detector at a time in order: (i, code) as a
        gate's push returns it, or (i, VERIFY, lag, mass) for a model the batched rows' path
        (``rel_rows``, channels.c) already stepped, whose mass passed its threshold. Each
        detector's change (or None)."""
        detectors = self.detectors
        out: list[Change | None] = [None] * len(detectors)
        for i, code, *stepped in asked:
            d = detectors[i]
            if code == VERIFY:
                out[i] = d._verify(key, int(stepped[0]), float(stepped[1]))
                continue
            x = d._after_push(code)
            if x is None:
                continue
            assert d._row is not None
            lag = min(d.max_lag, len(d._g) - 1)
            recent = d.bank.update_mass(d._row, x, lag)
            if lag >= 1 and recent > d.threshold:
                out[i] = d._verify(key, lag, recent)
        return out
