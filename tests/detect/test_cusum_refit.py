"""``CusumBank._refit`` in C (channels.c ``cusum_refit``: a selection per median) gives the
numpy reference's values bit for bit, over banks of several sizes, references of odd and even
lengths, ranks still learning and ranks not live."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from stalwart.detect import cusum
from stalwart.detect.cusum import CusumBank

pytestmark = pytest.mark.skipif(cusum._native_refit is None or not CusumBank.native,
                                reason="the C extension is not built")


@pytest.mark.parametrize("n,steps,seed", [(5, 40, 0), (64, 57, 1), (300, 90, 2),
                                          (1000, 130, 3), (37, 250, 4)])
def test_the_c_refit_matches_the_numpy_reference(n: int, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    bank = CusumBank(n, history=120)
    for k in range(steps):
        x = np.exp(rng.standard_t(3, n) * 0.05)  # heavy tails: ties and outliers in the refs
        x[rng.integers(n)] *= 2.0
        if k % 7 == 0:
            x[: n // 3] = np.round(x[: n // 3], 2)  # repeated values
        bank.add(k, x)
        if k % 11 == 5:
            bank.restart(int(rng.integers(n)))  # a rank back to learning
        ref = copy.deepcopy(bank)
        key = k + 1
        live = bank._live.copy()
        live[rng.integers(n, size=max(1, n // 10))] = False  # some ranks not live
        bank._live[:] = live
        ref._live[:] = live
        bank._refit(bank._live, key)
        ref._refit_py(ref._live, key)
        assert np.array_equal(bank.mu0, ref.mu0, equal_nan=True)
        assert np.array_equal(bank.sigma, ref.sigma, equal_nan=True)
