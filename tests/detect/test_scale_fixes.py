"""The decision code's scale fixes (issue 26): the BOCPD bank is built in O(N), and per-rank
alarm thresholds grow with the number of ranks so that the job-wide noise-alarm rate does not."""

from __future__ import annotations

import numpy as np

from stalwart.detect.bocpd import BOCPDBank
from stalwart.detect.cusum import REF_RANKS, CusumBank, per_rank_z
from stalwart.simulate.cost import _legacy_add_row


def test_bank_grown_by_doubling_updates_like_the_row_by_row_bank() -> None:
    rng = np.random.default_rng(0)
    new, old = BOCPDBank(max_run=20), BOCPDBank(max_run=20)
    for _ in range(37):  # crosses several capacity doublings
        new.add_row()
        _legacy_add_row(old)
    assert new.mu.shape == old.mu.shape == (37, 22) and new.n.shape == (37,)
    for r in range(37):
        new.reset(r, 0.1 * r, 1.0)
        old.reset(r, 0.1 * r, 1.0)
    for _ in range(30):
        x = rng.normal(size=37)
        assert np.allclose(new.update(slice(0, 37), x), old.update(slice(0, 37), x))
    assert new.update(3, 0.5).tolist() == old.update(3, 0.5).tolist()


def test_per_rank_significance_keeps_the_job_wide_tail() -> None:
    from statistics import NormalDist

    assert per_rank_z(1) == per_rank_z(REF_RANKS) == 2.5
    zs = [per_rank_z(n) for n in (8, 64, 1000, 10000)]
    assert zs == sorted(zs) and zs[0] > 2.5
    tail = NormalDist().cdf(-2.5) * REF_RANKS  # the 4-rank job's chance, per sample
    assert abs(NormalDist().cdf(-per_rank_z(10000)) * 10000 - tail) < 1e-9


def test_cusum_threshold_unchanged_up_to_4_ranks_and_higher_beyond() -> None:
    sig = np.array([0.16])
    small = CusumBank(4).threshold(sig)
    assert small[0] == 10.0 * 0.16
    big = CusumBank(10000)
    t = big.threshold(np.full(10000, 0.16))
    assert np.all(t > small[0]) and 1.5 < t[0] / small[0] < 2.5  # h 10 -> ~19 at sigma 0.16
    # a quiet rank (low sigma) needs little more: ARL grows fast with h there
    assert CusumBank(10000).threshold(np.full(10000, 0.02))[0] / 0.02 < 12.0


def test_large_shift_still_alarms_among_many_ranks() -> None:
    rng = np.random.default_rng(1)
    n = 2000
    bank = CusumBank(n)
    alarm_at = None
    for k in range(120):
        x = np.exp(rng.normal(0.0, 0.05, n))
        if k >= 60:
            x[7] *= 2.0
        out = bank.add(k, x)
        if out[7] is not None and alarm_at is None:
            alarm_at = k
    # a sample counts at most clip x sigma, so a 2x shift adds ~0.055 a step here: ~9 steps
    # to the 4-rank threshold, ~12 to the 2,000-rank one (BOCD+V catches a 2x shift sooner)
    assert alarm_at is not None and alarm_at - 60 <= 15
