"""A bank's first models started as arrays (changepoint._start_many, used by DetectorGroup
when many channels start in one step) leave exactly the state one start at a time leaves:
the same noise scales, levels, bank rows and posteriors, and the same changes after."""

from __future__ import annotations

import numpy as np

from stalwart.detect import changepoint
from stalwart.detect.bocpd import BOCPDBank
from stalwart.detect.changepoint import ChangeDetector, DetectorGroup


def _group(n: int) -> DetectorGroup:
    bank = BOCPDBank()
    return DetectorGroup([ChangeDetector(warmup=3, min_shift=0.15, z_sig=4.0, bank=bank)
                          for _ in range(n)])


def _state(g: DetectorGroup) -> list[object]:
    bank = g.detectors[0].bank
    gates = [d._g for d in g.detectors]
    return [[d._row for d in g.detectors], [x.scale for x in gates],
            [x.centre for x in gates], [x.model_updates for x in gates],
            [(x.model, x.live, x.quiet, x.scale_n) for x in gates],
            bank.mu.copy(), bank.beta.copy(), bank.log_beta.copy(), bank.logpost.copy(),
            bank.n.copy(),
            [[(c.onset, c.decided, c.before, c.after) for c in d.changes]
             for d in g.detectors]]


def test_start_many_equals_one_at_a_time(monkeypatch: object) -> None:
    n, steps = 300, 60
    rng = np.random.default_rng(5)
    x = np.exp(rng.standard_t(3, (steps, n)) * 0.05)
    x[::7, ::11] = np.nan  # missing samples: some channels start a step later
    x[35:, 17] *= 1.6  # a straggler and a recovering rank
    x[20:40, 42] *= 2.0
    runs = []
    calls: list[int] = []
    real = changepoint._start_many
    monkeypatch.setattr(changepoint, "_start_many",  # type: ignore[attr-defined]
                        lambda dets: (calls.append(len(dets)), real(dets)))
    for many in (changepoint.START_MANY, 10**9):  # arrays; one start at a time
        monkeypatch.setattr(changepoint, "START_MANY", many)  # type: ignore[attr-defined]
        g = _group(n)
        for k in range(steps):
            g.add(k, x[k].tolist())
        runs.append(_state(g))
    a, b = runs
    for u, v in zip(a, b, strict=True):
        if isinstance(u, np.ndarray):
            assert np.array_equal(u, v)
        else:
            assert u == v
    assert calls and max(calls) > n // 2  # the array path ran, for most channels at once
    assert any(a[-1])  # some channel changed: the state after the starts was exercised
