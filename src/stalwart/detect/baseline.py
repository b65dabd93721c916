"""The hand-written baseline: a sliding-window threshold over each rank's compute time.

What a user writes without a straggler detector: per rank, compare each step's compute time
(forward, backward, optimizer: what the rank itself spends, not the step time, which is the
same on every rank of a synchronous job) with the median of the previous ``window`` steps;
``consecutive`` steps above ``factor`` x that median raise an alarm naming the rank furthest
above its own median, as a compute problem. Used by ``stalwart bench detect`` as the
comparison. It has no notion of a link (a slow link lengthens every rank's wait, and ranks
whose backward overlaps communication see it in their compute time too), no validation,
and no statistics beyond the threshold -- which is the point the benchmark makes.
"""

from __future__ import annotations

import statistics
from collections import deque


def threshold_detector(compute_times: dict[int, dict[int, float]], window: int = 20,
                       factor: float = 1.2, consecutive: int = 3,
                       warmup: int = 10) -> list[dict]:
    """Detections from ``{step: {rank: compute_time}}`` (each rank's own compute time per
    step, as ``stalwart bench detect`` feeds it: ``RunData.step_table("compute_time")``):
    dicts with event, step, onset_step, kind ("compute"), ranks ([r]). A recovery is
    reported when every rank is back below the threshold (of the reference frozen at the
    alarm) for ``consecutive`` steps."""
    out: list[dict] = []
    hist: dict[int, deque[float]] = {}
    over: dict[int, int] = {}
    active_ref: dict[int, float] | None = None
    ok_run = 0
    for step in sorted(compute_times):
        row = compute_times[step]
        if step < warmup:
            continue
        if active_ref is None:
            ratios = {}
            for r, v in row.items():
                h = hist.setdefault(r, deque(maxlen=window))
                if len(h) >= window // 2:
                    ref = statistics.median(h)
                    ratios[r] = v / ref
                    over[r] = over.get(r, 0) + 1 if v > factor * ref else 0
                h.append(v)
            hot = [r for r in ratios if over.get(r, 0) >= consecutive]
            if hot:
                r = max(hot, key=lambda k: ratios[k])
                out.append({"event": "straggler_detected", "step": step,
                            "onset_step": step - consecutive + 1, "kind": "compute",
                            "ranks": [r]})
                active_ref = {k: statistics.median(h) for k, h in hist.items() if h}
                over.clear()
                ok_run = 0
        else:
            fine = all(v <= factor * active_ref.get(r, v) for r, v in row.items())
            ok_run = ok_run + 1 if fine else 0
            if ok_run >= consecutive:
                out.append({"event": "straggler_recovered", "step": step,
                            "onset_step": step - consecutive + 1})
                active_ref = None
                hist.clear()
    return out
