"""The BOCPD step in C (detect/_native/bocpd.c) against the Python reference: the same
posteriors and bank state, one row or several, before and after the run-length cap."""

from __future__ import annotations

import os

import numpy as np
import pytest

from stalwart.detect import bocpd
from stalwart.detect.bocpd import BOCPDBank

needs_native = pytest.mark.skipif(bocpd._native_update is None,
                                  reason="native step not built")


def test_the_native_step_is_built_where_required() -> None:
    """CI builds every native part (STALWART_REQUIRE_NATIVE=1, .ci/run)."""
    if os.environ.get("STALWART_REQUIRE_NATIVE") == "1":
        assert bocpd._native_update is not None, "stalwart.detect._bocpd was not built"


def _pair(max_run: int, rows: int) -> tuple[BOCPDBank, BOCPDBank]:
    banks = []
    for native in (True, False):
        b = BOCPDBank(hazard=1 / 50, max_run=max_run)
        b.native = native
        for r in range(rows):
            b.reset(b.add_row(), 0.1 * r, 0.5 + r)
        banks.append(b)
    return banks[0], banks[1]


@needs_native
@pytest.mark.parametrize("max_run", [5, 37])
def test_the_native_step_equals_the_reference(max_run: int) -> None:
    rng = np.random.default_rng(0)
    nat, ref = _pair(max_run, 4)
    for t in range(3 * max_run):
        x = rng.normal(0.0, 1.0, 4) + (2.0 if t > max_run else 0.0)
        if t % 3 == 0:  # one row
            a, b = nat.update(t % 4, float(x[0])), ref.update(t % 4, float(x[0]))
        elif t % 3 == 1:  # a slice of rows
            a, b = nat.update(slice(0, 4), x), ref.update(slice(0, 4), x)
        else:  # a list of rows, one row behind the others
            ids = np.array([0, 2, 3])
            a, b = nat.update(ids, x[:3]), ref.update(ids, x[:3])
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(nat.n, ref.n)
        for r in range(4):
            k = int(ref.n[r])
            np.testing.assert_allclose(nat.logpost[r, :k], ref.logpost[r, :k], rtol=1e-12)
            np.testing.assert_allclose(nat.mu[r, :k + 1], ref.mu[r, :k + 1], rtol=1e-12)
            np.testing.assert_allclose(nat.beta[r, :k + 1], ref.beta[r, :k + 1], rtol=1e-12)


@needs_native
@pytest.mark.parametrize("max_run", [5, 37])
def test_the_native_mass_step_equals_the_reference(max_run: int) -> None:
    """``update_mass`` (what a ChangeDetector calls): the same mass of the shortest run
    lengths and the same bank state as the reference's posterior summed in order."""
    rng = np.random.default_rng(1)
    nat, ref = _pair(max_run, 3)
    for t in range(3 * max_run):
        r, lag = t % 3, 1 + t % 13
        x = float(rng.normal(0.0, 1.0)) + (2.0 if t > max_run else 0.0)
        a, b = nat.update_mass(r, x, lag), ref.update_mass(r, x, lag)
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15)
        np.testing.assert_array_equal(nat.n, ref.n)
        k = int(ref.n[r])
        np.testing.assert_allclose(nat.logpost[r, :k], ref.logpost[r, :k], rtol=1e-12)
        np.testing.assert_allclose(nat.mu[r, :k + 1], ref.mu[r, :k + 1], rtol=1e-12)


@pytest.mark.skipif(bocpd._native_replay is None or bocpd._native_step is None,
                    reason="native replay not built")
@pytest.mark.parametrize("max_run", [5, 300])
def test_the_native_replay_equals_one_step_at_a_time(max_run: int) -> None:
    """``BOCPDBank.replay`` in one C call: the bank state of its loop of C steps (each value
    clipped as min(max(x, lo), hi)), past the run-length cap and with values on both clips."""
    rng = np.random.default_rng(max_run)
    banks = [BOCPDBank(hazard=1 / 50, max_run=max_run) for _ in range(2)]
    for b in banks:
        for r in range(3):
            b.reset(b.add_row(), 0.1 * r, 0.5 + r)
    for _ in range(4):
        xs = rng.normal(0.0, 1.0, int(rng.integers(0, 40)))
        row = int(rng.integers(3))
        lo, hi = -1.0, 1.2  # some of the draws fall outside
        banks[0].replay(row, xs, lo, hi)
        for x in xs:
            banks[1].update_mass(row, min(max(float(x), lo), hi), 0)
        for a in ("mu", "beta", "log_beta", "logpost", "n"):
            np.testing.assert_array_equal(getattr(banks[0], a), getattr(banks[1], a))
