"""From NOISE_RUN_RANKS ranks a per-rank slowdown is judged against the job's own cross-rank
noise (decision._noise_run): a run of a few high samples that other ranks show as often at
the same steps raises no alarm; a rank slower than every other raises one at once."""

from __future__ import annotations

import numpy as np

from stalwart.detect.alarms import DETECT, NONE, IterSample
from stalwart.detect.changepoint import Change
from stalwart.detect.decision import NOISE_RUN_ALPHA, NOISE_RUN_RANKS, DecisionCore

N = 256


def _core_with_rows(rows: list[np.ndarray]) -> DecisionCore:
    core = DecisionCore(True, warmup=10, audit=False)
    for k, rel in enumerate(rows):
        core.sample(IterSample(k, 0.2, 0.1, 0.1))
        core.relative(k, (0.1 * rel).tolist())
        core.take_pending(travels=False)
    return core


def test_a_run_as_common_as_the_cross_rank_noise_is_not_an_alarm() -> None:
    rng = np.random.default_rng(0)
    # heavy-tailed noise: ~10% of the ranks read >= 1.12x at any step
    rows = [np.exp(rng.standard_t(2, N) * 0.06) for _ in range(40)]
    core = _core_with_rows(rows)
    ch = Change(36, 39, 1.0, 1.2)  # rank 7 at ~1.2x for 3 steps: the midpoint ~1.095
    assert core._noise_run(ch, "rank7", DETECT)
    core.classify(ch, "rank7")
    assert core.pending.action == NONE


def test_a_rank_slower_than_every_other_passes_at_once() -> None:
    rng = np.random.default_rng(1)
    rows = [np.exp(rng.normal(0.0, 0.03, N)) for _ in range(40)]
    for r in rows[36:]:
        r[7] = 1.3
    core = _core_with_rows(rows)
    ch = Change(36, 39, 1.0, 1.3)
    assert not core._noise_run(ch, "rank7", DETECT)
    core.classify(ch, "rank7")
    assert core.pending.action == DETECT and core.pending.suspect == 7


def test_the_budget_is_the_four_rank_jobs_and_small_jobs_are_untouched() -> None:
    assert 0.02 < NOISE_RUN_ALPHA < 0.03  # 4 x P(z > 2.5)
    rng = np.random.default_rng(2)
    small = DecisionCore(True, warmup=10, audit=False)
    for k in range(40):
        small.relative(k, (0.1 * np.exp(rng.standard_t(2, NOISE_RUN_RANKS - 1) * 0.06)).tolist())
    assert not small._noise_run(Change(36, 39, 1.0, 1.2), "rank7", DETECT)
