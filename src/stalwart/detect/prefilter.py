"""The pre-filter that keeps a change detector's model asleep while no change can be verified.

Mechanism: verification (changepoint.py) needs the median of at least ``confirm`` new samples
to sit ``min_shift`` (and ``z_sig`` standard errors) from the old level, so no change can be
accepted before two of three samples in a row lie half that distance from the segment's
centre. Until they do, a sample only joins the current segment; when they do, the detector
rebuilds its model from the segment's last ``REPLAY`` samples (changepoint.py; the posterior
forgets older ones anyway: a change must be within ``max_lag`` samples to count) and updates
it every sample until ``max_lag`` samples in a row are quiet again. ``gate=False`` asks for a model
update on every sample. The segment's noise scale is re-estimated each time it doubles, and
what the model sees is winsorised to +-``clip`` scales of the model's level.

Guarantees: bounded memory (a segment of at most ``history`` samples); the first ``warmup``
samples, non-positive and non-finite times are ignored; the model sleeps only while no change
could be verified (two far samples of three wake it, before any could be). ``PyGate`` is the
Python reference of the C ``Gate`` (detect/_native/channels.c), which tests compare it with.
Cost: a sample the model sleeps through is a few scalar operations (in C, one call, and a
bank's detectors push in one: ``DetectorGroup``); on a clean tiny-preset run this cut the
detector's per-sample CPU several-fold (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from stalwart.detect.robust import robust_scale

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
