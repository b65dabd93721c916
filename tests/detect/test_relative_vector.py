"""``DecisionCore.relative`` on arrays (from ``VECTOR_RANKS`` ranks) decides as on lists: the
same alarms at the same steps and the same channel state, on random jobs with slow ranks and
bad samples (a rank's non-positive or non-finite compute skips the step)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stalwart.detect import decision
from stalwart.detect.alarms import IterSample
from stalwart.detect.decision import DecisionCore


def _drive(n: int, seed: int, vector: bool, monkeypatch: pytest.MonkeyPatch) -> list:
    monkeypatch.setattr(decision, "VECTOR_RANKS", 64 if vector else 10**9)
    rng = np.random.default_rng(seed)
    core = DecisionCore(True, audit=False)
    slow = rng.choice(n, 3, replace=False)
    seen = []
    for k in range(120):
        comp = 0.1 * np.exp(rng.normal(0.0, 0.08, n))
        if k >= 50:
            comp[slow] *= [1.3, 1.6, 2.5]
        row = comp.tolist()
        if k in (30, 77):
            row[int(rng.integers(n))] = [0.0, math.nan][k % 2]
        core.sample(IterSample(k, float(np.median(comp)) * 1.2, row[0], 0.01))
        core.relative(k, np.asarray(row) if vector and k % 2 else row)
        a = core.take_pending()
        seen.append((a.action, a.onset, a.suspect, a.severity))
        if a.action:
            core.alarm_read() if core.deciding else None
    state = [seen, core.cusum.mu0.tolist(), core.cusum.s.tolist(), core.outliers.line.tolist(),
             [d.min_scale for d in core.rel_detectors.values()],
             [len(d.changes) for d in core.rel_detectors.values()]]
    return state


@pytest.mark.parametrize("n", [64, 257])
def test_arrays_decide_as_lists(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    for seed in range(2):
        ref = _drive(n, seed, False, monkeypatch)
        got = _drive(n, seed, True, monkeypatch)
        assert got == ref
        assert any(a[0] for a in ref[0])  # alarms were raised (and compared)
