"""The per-rank banks' vector paths equal their one-rank-at-a-time references exactly:
``CusumBank._fit_many`` against ``_fit`` per rank, ``OutlierBank._test`` against
``_test_each`` -- on random series with shifted ranks (alarms, restarts and refits), at small
and large rank counts."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.detect.cusum import CusumBank
from stalwart.detect.outlier import OutlierBank


def _series(seed: int, n: int, steps: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    comp = 0.1 * np.exp(rng.normal(0.0, rng.uniform(0.02, 0.2), (steps, n)))
    slow = rng.choice(n, size=max(1, n // 8), replace=False)
    comp[steps // 3:, slow] *= rng.uniform(1.1, 2.0, slow.size)  # some ranks turn slow
    comp[:, rng.choice(n)] *= 1.4  # one slow from the start (outliers)
    return comp


def _per_rank_fits(bank: CusumBank) -> None:
    bank._fit_many = lambda rows, upto: [bank._fit(int(r), upto) for r in rows]  # type: ignore[method-assign]


@pytest.mark.parametrize("n", [2, 4, 5, 33, 400])
def test_cusum_fit_many_equals_one_fit_per_rank(n: int) -> None:
    for seed in range(3):
        comp = _series(seed, n, 160)
        fast, ref = CusumBank(n, learn=18), CusumBank(n, learn=18)
        _per_rank_fits(ref)
        alarms = 0
        for k, row in enumerate(comp):
            rel = row / np.median(row)
            a, b = fast.add(k, rel.tolist()), ref.add(k, rel.tolist())
            assert a == b
            alarms += sum(x is not None for x in a)
            if k == 90 and alarms:  # an unconfirmed alarm's backoff and restart too
                r = next(i for i, x in enumerate(a) if x is not None) if any(a) else 0
                for bank in (fast, ref):
                    bank.unconfirmed(r)
                    bank.restart(r)
        for name in ("mu0", "sigma", "s", "zero_key", "start_key", "backoff"):
            assert np.array_equal(getattr(fast, name), getattr(ref, name), equal_nan=True)
        assert fast.alarms == ref.alarms
    assert alarms  # the series did make alarms (so refits after restarts were compared)


@pytest.mark.parametrize("n", [3, 4, 17, 300])
def test_outlier_vector_test_equals_the_loop(n: int) -> None:
    for seed in range(3):
        comp = _series(seed + 10, n, 260)
        fast, ref = OutlierBank(n), OutlierBank(n)
        ref._test = ref._test_each  # type: ignore[method-assign]
        found = 0
        for k, row in enumerate(comp):
            a, b = fast.add(k, row, 0.05), ref.add(k, row, 0.05)
            assert a == b
            found += len(a)
            for o in a:
                fast.unconfirmed(o.rank)
                ref.unconfirmed(o.rank)
        assert np.array_equal(fast.line, ref.line) and fast.alarms == ref.alarms
    assert found
