"""Rank 0's decision cost against the number of ranks, before and after the scale fixes.

Mechanism: for each N, a clean simulated job (no faults) of ``steps`` steps under the full
policy; per step the thread CPU time of the product's decision code (decide.py: detector
feed, validation verdicts, policy), without the simulator's own work. Two variants:
- ``after``: the code as it is;
- ``before``: the three scale fixes undone for the measurement (``legacy``): the BOCPD bank
  grown by one ``np.vstack`` per rank (O(N^2) to build: the whole bank copied for each new
  row), per-rank alarm thresholds that do not grow with N (every rank's channel a test at
  the 4-rank level, so the job pauses N/4 times as often for noise), and no noise floor
  pooled over ranks.
Reported per N: median, p99 and max ms per step, validation pauses per 1,000 steps.
Cost of this sweep: dominated by the largest N (~0.1-0.2 s per step at 10,000 ranks here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from stalwart.detect import changepoint, decision
from stalwart.detect.cusum import CusumBank
from stalwart.simulate.engine import Engine, Settings
from stalwart.simulate.model import Job
from stalwart.simulate.noise import Noise


def _legacy_add_row(self: changepoint.BOCPDBank) -> int:
    """BOCPDBank.add_row as it was: the bank copied whole for every new row."""
    w = self.max_run + 2
    self.mu = np.vstack([self.mu, np.zeros((1, w))])
    self.beta = np.vstack([self.beta, np.ones((1, w))])
    self.log_beta = np.vstack([self.log_beta, np.zeros((1, w))])
    self.logpost = np.vstack([self.logpost, np.full((1, self.max_run), -np.inf)])
    self.n = np.append(self.n, 0)
    return len(self.n) - 1


class _FlatCusum(CusumBank):
    def __init__(self, n: int, **kw: Any) -> None:
        super().__init__(n, ref=max(n, 1), **kw)  # thresholds as at 4 ranks, whatever n


@contextmanager
def legacy() -> Iterator[None]:
    """The decision code with the two scale fixes undone (module docstring)."""
    saved = (changepoint.BOCPDBank.add_row, decision.per_rank_z, decision.CusumBank,
             decision.POOLED_FLOOR)
    changepoint.BOCPDBank.add_row = _legacy_add_row  # type: ignore[method-assign]
    decision.per_rank_z = lambda n, z=2.5, ref=4: z  # type: ignore[assignment]
    decision.CusumBank = _FlatCusum  # type: ignore[misc]
    decision.POOLED_FLOOR = 0.0  # max(own floor, 0): each channel's own estimate
    try:
        yield
    finally:
        (changepoint.BOCPDBank.add_row, decision.per_rank_z,  # type: ignore[method-assign]
         decision.CusumBank, decision.POOLED_FLOOR) = saved  # type: ignore[misc]


def measure(job_for: Callable[[int], Job], ns: list[int], steps: int, noise: Noise,
            settings: Settings, before: bool = False,
            report: Callable[[str, int, int], None] | None = None) -> list[dict[str, Any]]:
    """One row per N (module docstring)."""
    rows = []
    for n in ns:
        job = job_for(n)
        s = Settings(policy="auto", restart_s=settings.restart_s,
                     validation_s=settings.validation_s, seed=settings.seed)
        name = f"cost {'before' if before else 'after'} N={n}"
        eng = Engine(job, [], noise, s, progress=(lambda d, nm=name: report(nm, d, steps))
                     if report else None)
        if before:
            with legacy():
                out = eng.run(steps, name)
        else:
            out = eng.run(steps, name)
        d = np.asarray(out.decision_s) * 1e3
        rows.append({"ranks": job.ranks, "variant": "before" if before else "after",
                     "ms_median": round(float(np.median(d)), 3),
                     "ms_p99": round(float(np.percentile(d, 99)), 2),
                     "ms_max": round(float(d.max()), 1),
                     "pauses_per_1000_steps": round(1000.0 * out.pauses / steps, 1),
                     "step_s": round(out.jct_s / steps, 3)})
    return rows
