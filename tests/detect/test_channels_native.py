"""The per-rank channels' step and the change detectors' pre-filter in C
(detect/_native/channels.c) against the Python reference (``CusumBank._step``,
``OutlierBank._step``, ``prefilter.PyGate``): the same state after every step and the same
alarms, on random series with shifts, ties, outliers and a rank slow from the start."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.detect import changepoint, cusum, outlier
from stalwart.detect.bocpd import BOCPDBank
from stalwart.detect.changepoint import ChangeDetector
from stalwart.detect.cusum import CusumBank
from stalwart.detect.outlier import OutlierBank

needs_native = pytest.mark.skipif(cusum._native_step is None or outlier._native_step is None,
                                  reason="native channel steps not built")
needs_gate = pytest.mark.skipif(changepoint._NativeGate is None, reason="native gate not built")


def test_the_native_steps_are_built_where_required() -> None:
    """CI builds every native part (STALWART_REQUIRE_NATIVE=1, .ci/run)."""
    if os.environ.get("STALWART_REQUIRE_NATIVE") == "1":
        assert cusum._native_step is not None and outlier._native_step is not None
        assert changepoint._NativeGate is not None


def _series(seed: int, n: int, steps: int, ties: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.exp(rng.normal(0.0, 0.12, (steps, n)))
    x[steps // 3:, seed % n] *= 1.0 + 0.2 * (seed % 4)  # a shift (none when seed % 4 == 0)
    x[:, (seed + 1) % n] *= 1.0 + 0.1 * (seed % 3)  # a rank slower from the start
    spikes = rng.random((steps, n)) < 0.02
    x[spikes] *= 4.0  # outliers
    if ties:
        x = np.round(x, 1)  # many equal values: the peer medians' ties
    return x


def _cusum_state(b: CusumBank) -> list[np.ndarray]:
    return [b.seen, b.start_key, b.mu0, b.sigma, b.s, b.zero_key, b._keys, b._xs,
            b.backoff, np.array([b.alarms])]


@needs_native
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 9), ties=st.booleans(),
       backoff=st.booleans())
def test_the_native_cusum_step_equals_the_reference(seed: int, n: int, ties: bool,
                                                      backoff: bool) -> None:
    banks = []
    for native in (True, False):
        b = CusumBank(n, warmup=3, learn=6, history=40, ref=2)
        b.native = native
        banks.append(b)
    nat, ref = banks
    for t, row in enumerate(_series(seed, n, 160, ties)):
        rel = row / np.median(row)
        a, b = nat.add(t, rel), ref.add(t, list(rel))
        assert a == b
        if backoff and any(a):  # an unconfirmed alarm raises that rank's threshold
            for r, ch in enumerate(a):
                if ch is not None:
                    nat.unconfirmed(r)
                    ref.unconfirmed(r)
        for x, y in zip(_cusum_state(nat), _cusum_state(ref), strict=True):
            np.testing.assert_array_equal(x, y)


@needs_native
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 9), ties=st.booleans())
def test_the_native_outlier_step_equals_the_reference(seed: int, n: int, ties: bool) -> None:
    banks = []
    for native in (True, False):
        b = OutlierBank(n, window=24, min_window=10, stride=3, alpha=50.0, warmup=2)
        b.native = native
        banks.append(b)
    nat, ref = banks
    for t, row in enumerate(_series(seed, n, 150, ties)):
        a, b = nat.add(t, row, 0.05), ref.add(t, list(row), 0.05)
        assert a == b
        for o in a:
            if o.rank % 2:
                nat.unconfirmed(o.rank)
                ref.unconfirmed(o.rank)
        for x, y in ((nat._over, ref._over), (nat._logrel, ref._logrel),
                     (nat._excess, ref._excess), (nat._keys, ref._keys),
                     (nat.count, ref.count), (nat.filled, ref.filled),
                     (nat._whole, ref._whole), (nat.line, ref.line)):
            np.testing.assert_array_equal(x, y)


@needs_native
def test_the_native_steps_check_their_arrays() -> None:
    b = CusumBank(3)
    with pytest.raises(ValueError, match="ratios"):
        b.add(0, [1.0, 1.0])
    o = OutlierBank(3, warmup=0)
    with pytest.raises(ValueError, match="wrong size"):
        o.add(0, [1.0, 1.0], 0.1)


def _gate_state(d: ChangeDetector) -> tuple[object, ...]:
    g = d._g
    keys, vals = d._segment()
    return (g.seen, g.pos, g.quiet, g.far, g.slept, g.model_updates, g.scale_n, bool(g.pending),
            bool(g.live), bool(g.model), g.scale if g.scale == g.scale else None, g.centre,
            keys.tolist(), vals.tolist())


@needs_gate
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), gate=st.booleans(), history=st.sampled_from([16, 60, 400]),
       shift=st.sampled_from([1.0, 1.15, 1.5, 2.0]), ranks=st.integers(1, 5))
def test_the_native_gate_equals_the_reference(seed: int, gate: bool, history: int,
                                              shift: float, ranks: int) -> None:
    """The ChangeDetector's pre-filter and segment in C (``Gate``) against ``PyGate``: the
    same changes, the same state after every sample, alone (``add``) and in a bank
    (``add_many``), through warm-up, invalid samples, sleep, wake-ups and accepted changes."""
    rng = np.random.default_rng(seed)
    steps = 260
    xs = np.exp(rng.normal(np.log(0.08), 0.1, (steps, ranks)))
    xs[steps // 3:, 0] *= shift
    xs[2 * steps // 3:, -1] /= shift
    xs[rng.random((steps, ranks)) < 0.02] = 0.0  # invalid samples are skipped
    xs[rng.random((steps, ranks)) < 0.03] *= 3.0  # spikes
    pairs = []
    for native in (True, False):
        bank = BOCPDBank()
        dets = [ChangeDetector(min_shift=0.1, history=history, gate=gate, bank=bank,
                               native=native) for _ in range(ranks)]
        pairs.append(dets)
    nat, ref = pairs
    for t in range(steps):
        row = [float(v) for v in xs[t]]
        if t % 2:
            a = ChangeDetector.add_many(nat, t, row)
            b = ChangeDetector.add_many(ref, t, row)
        else:
            a = [d.add(t, v) for d, v in zip(nat, row, strict=True)]
            b = [d.add(t, v) for d, v in zip(ref, row, strict=True)]
        assert a == b
        for dn, dr in zip(nat, ref, strict=True):
            assert _gate_state(dn) == _gate_state(dr)
