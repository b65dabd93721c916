"""Where the monitor's iteration samples come from: the loop's step hints, or the op sequence.

A hint (``monitor.step(step, metrics)``) gives the step time and, when the loop measures them,
its compute and communication times; without those, communication is the time some tracked op
was in flight (``comm_busy``) and compute the rest. Without hints, iterations are found from
the period of the tracked op sequence (period.py, FALCON), ops smaller than
``MIN_PERIOD_NUMEL`` elements (control traffic) ignored.

The timing source is this module's: a device-timed source (CUDA events) plugs in here, giving
the same ``IterSample``. Cost: a few scalar operations per step; without measured times, one
pass over the last second of op records.
"""

from __future__ import annotations

import time
from typing import Any

from stalwart.detect.alarms import IterSample
from stalwart.detect.period import PeriodTracker
from stalwart.detect.tracking import OpRecord, Tracker

MIN_PERIOD_NUMEL = 1024  # FALCON skips tiny ops (control traffic: losses, flags, barriers)
# ``_new(IterSample, (k, s, cp, cm))`` is ``IterSample(k, s, cp, cm)`` without the named
# tuple's Python-level __new__ (a frame, a few us on caches a training step evicted)
_new = tuple.__new__


def comm_busy(records: list[OpRecord], t0: float, t1: float) -> float:
    """Seconds within [t0, t1] during which at least one tracked op was in flight."""
    spans = []
    for r in records:
        end = r.finish()
        a, b = max(r.issue, t0), min(end if end is not None else r.issue, t1)
        if b > a:
            spans.append((a, b))
    spans.sort()
    busy, cur_a, cur_b = 0.0, None, None
    for a, b in spans:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        busy += cur_b - cur_a
    return busy


class Sampler:
    """Turns hints or tracked ops into ``IterSample``s (see the module docstring)."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.periods = PeriodTracker()
        self.last_hint: float | None = None  # when the last hint came (None: restart clock)
        self._iter = 0

    def from_hint(self, step: int, metrics: dict[str, Any] | None) -> IterSample | None:
        """The sample of a step hint; None for the first hint without a step time."""
        now = time.perf_counter()
        m = metrics or {}
        since, self.last_hint = self.last_hint, now
        seconds = m.get("step_time")
        compute, comm = m.get("compute_time"), m.get("comm_time")
        # the loop measures its own compute and communication: no record would be read
        self.tracker.recording = seconds is None or compute is None or comm is None
        if seconds is None:
            if since is None:
                return None
            seconds = now - since
        if compute is None or comm is None:
            t0 = now - float(seconds)
            comm = comm_busy(self.tracker.recent(t0 - 1.0), t0, now)
            compute = float(seconds) - comm
        return _new(IterSample, (step, float(seconds), float(compute), float(comm)))

    def from_op(self, rec: OpRecord) -> IterSample | None:
        """An op about to be issued: the sample of the iteration it closes, if it closes one."""
        if rec.numel < MIN_PERIOD_NUMEL:
            return None
        b = self.periods.push(hash((rec.op, rec.group, rec.numel)), time.perf_counter())
        if b is None:
            return None
        key, self._iter = self._iter, self._iter + 1
        comm = comm_busy(self.tracker.recent(b.start - 1.0), b.start, b.end)
        return IterSample(key, b.end - b.start, b.end - b.start - comm, comm)
