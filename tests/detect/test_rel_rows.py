"""The batched rows' path (``DecisionCore.relative_rows``, ``rel_rows`` in channels.c) against
its reference, ``DecisionCore.relative`` one row at a time: the same alarms and the same state
of every per-rank channel (gates, BOCPD bank, CUSUM and outlier banks) after every batch, on
random streams with a slow rank, spikes and invalid rows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stalwart.detect import decision
from stalwart.detect.alarms import NONE, IterSample
from stalwart.detect.decision import DecisionCore

pytestmark = pytest.mark.skipif(decision._rel_rows is None, reason="channels.c not built")

GATE_FIELDS = ("seen", "pos", "quiet", "far", "slept", "model_updates", "scale_n", "pending",
               "live", "model", "scale", "centre", "x", "min_scale")


def _stream(seed: int, n: int, steps: int) -> list[tuple[int, float, list[float]]]:
    """(key, rank 0's step seconds, every rank's compute) per step: log-normal noise, one rank
    slowed by 1.3-2.5x from a random step, rare spikes, and rows with an invalid value."""
    rng = np.random.default_rng(seed)
    slow, onset, factor = int(rng.integers(n)), int(rng.integers(30, 250)), rng.uniform(1.3, 2.5)
    out = []
    for k in range(steps):
        comps = (0.05 * np.exp(rng.normal(0.0, rng.choice((0.03, 0.1, 0.2)), n))).tolist()
        if k >= onset:
            comps[slow] *= factor
        if rng.random() < 0.03:
            comps[int(rng.integers(n))] *= 6.0  # a spike
        if rng.random() < 0.02:
            comps[int(rng.integers(n))] = float(rng.choice((0.0, math.nan, math.inf, -1.0)))
        out.append((k, 0.06 + 0.9 * max(c for c in comps if 0 < c < math.inf), comps))
    return out


def _state(core: DecisionCore) -> str:
    """Everything the rows touch, as text (exact floats; nan equal to nan)."""
    s: list[object] = [core.pending, [(ch.onset, ch.decided, ch.before, ch.after, name)
                                      for ch, name in core._deferred]]
    for r, d in sorted(core.rel_detectors.items()):
        g = d._g
        s.append((r, d._row, [getattr(g, f) for f in GATE_FIELDS], len(g),
                  d._segment()[0].tolist(), d._segment()[1].tolist(),
                  [(c.onset, c.decided, c.before, c.after) for c in d.changes]))
    if core.rel_detectors:
        bank = core.rel_detectors[0].bank
        s += [a.tolist() for a in (bank.mu, bank.beta, bank.log_beta, bank.logpost, bank.n)]
    cb, ob = core.cusum, core.outliers
    if cb is not None:
        s += [cb._pos, cb.alarms] + [a.tolist() for a in (
            cb._keys, cb._xs, cb.seen, cb.start_key, cb.mu0, cb.sigma, cb.s, cb.zero_key,
            cb.backoff)]
    if ob is not None:
        s += [ob._pos, ob.seen, ob.alarms] + [a.tolist() for a in (
            ob._keys, ob._over, ob._logrel, ob._excess, ob.count, ob.filled, ob._whole,
            ob.line, ob.last_level)]
    return repr(s)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_batched_rows_equal_one_row_at_a_time(n: int, seed: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    native = decision._rel_rows

    def counted(*a: object) -> object:
        calls[0] += 1
        return native(*a)  # type: ignore[misc]

    monkeypatch.setattr(decision, "_rel_rows", counted)
    rng = np.random.default_rng(100 + seed)
    ref, bat = DecisionCore(True), DecisionCore(True)
    events = 0
    stream = _stream(seed, n, 420)
    i = 0
    while i < len(stream):
        batch = stream[i:i + int(rng.integers(1, 13))]  # a check's rows: 1 to 12
        i += len(batch)
        for core in (ref, bat):
            for k, st, comps in batch:
                core.sample(IterSample(k, st, comps[0], 0.01))
        for k, _, comps in batch:
            ref.relative(k, comps)
        bat.relative_rows([(k, comps) for k, _, comps in batch])
        assert _state(bat) == _state(ref), f"differ after step {batch[-1][0]}"
        if ref.pending.action != NONE:  # sent and forgotten: later changes raise again
            events += 1
            assert bat.take_pending(travels=False) == ref.take_pending(travels=False)
        if rng.random() < 0.05 and ref.outliers is not None:  # an alarm the tests rejected
            r = int(rng.integers(n))
            for core in (ref, bat):
                assert core.outliers is not None and core.cusum is not None
                core.outliers.unconfirmed(r)
                core.cusum.unconfirmed(r)
    assert calls[0] > 0  # the batched path ran
    changes = sum(len(d.changes) for d in ref.rel_detectors.values())
    assert events + changes + (ref.cusum.alarms if ref.cusum else 0) > 0  # it raised alarms


def test_more_ranks_than_the_batch_takes_go_one_row_at_a_time() -> None:
    """Above REF_RANKS (the pooled noise floor) ``relative_rows`` is ``relative`` per row."""
    n = 6
    ref, bat = DecisionCore(True), DecisionCore(True)
    for k, st, comps in _stream(7, n, 120):
        for core in (ref, bat):
            core.sample(IterSample(k, st, comps[0], 0.01))
        ref.relative(k, comps)
        bat.relative_rows([(k, comps)])
    assert _state(bat) == _state(ref)
