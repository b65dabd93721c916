"""Rank 0's first steps at scale cost far less than linearly more with the ranks.

The simulator's first steps hold every per-rank channel's start (BOCD+V models, CUSUM
references) and the audit's validation (every rank's evidence, the sign test of every rank
against its peers). A 10,000-rank job did not get past step 16 of its first scenario with a
policy in 10 minutes: the audit compared each rank with its peers one rank at a time
(O(N^2)). Counted in function calls (Python and built-in, by cProfile: deterministic,
unlike CPU time on a shared machine), the first 45 steps -- warm-up, the channels' starts
and the audit -- must grow at most ``GROWTH_MAX`` x from 1,000 to 10,000 ranks: the O(N^2)
audit grew ~100x; with every rank's channel started one at a time (a Python call chain per
rank) 3.3x; with the starts as arrays (changepoint._start_many) 2.4x -- what still grows is
the evidence's one object per rank (the product's interface) and the gates' C calls."""

from __future__ import annotations

import cProfile

import numpy as np

from stalwart.simulate.decide import Evidence, SimDetector

STEPS = 45  # warm-up 10, the channels start at ~17 and ~28, the audit at ~40
GROWTH_MAX = 3.0


def _first_steps_calls(n: int) -> tuple[int, bool]:
    rng = np.random.default_rng(0)
    det = SimDetector(n, np.random.default_rng(1))
    comp_hist = np.zeros((STEPS, n))
    step_hist = np.zeros(STEPS)
    host_of = np.arange(n) // 8
    prof = cProfile.Profile()  # (C: counting costs little beside the work counted)
    for k in range(STEPS):
        comp = 0.1 * np.exp(rng.normal(0.0, 0.05, n))
        step_hist[k] = float(comp.max()) * 1.3
        comp_hist[k] = comp

        def evidence(k: int = k) -> Evidence:
            return Evidence(np.ones(n), np.ones(host_of[-1] + 1), host_of,
                            np.arange(k + 1), comp_hist[:k + 1], step_hist[:k + 1])

        prof.enable()
        try:
            det.feed(k, float(step_hist[k]), comp, 0.01, evidence)
        finally:
            prof.disable()
    calls = sum(e.callcount for e in prof.getstats())
    return calls, det.core.audit is not None


def test_first_steps_grow_far_less_than_the_ranks() -> None:
    small, audited_small = _first_steps_calls(1000)
    large, audited_large = _first_steps_calls(10000)
    assert audited_small and audited_large  # the audit ran within the steps counted
    assert large <= GROWTH_MAX * small, (small, large)
