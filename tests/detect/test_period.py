"""Iteration period from synthetic op sequences (ACF + exact repetition)."""

from __future__ import annotations

import random

from stalwart.detect.period import PeriodTracker, acf, find_period, repeats_exactly


def test_finds_period_of_repeating_op_pattern() -> None:
    it = [1, 2, 2, 3, 1, 4]  # e.g. fwd all-gather, 2 buckets, a reduce-scatter, ...
    assert find_period(it * 10) == len(it)


def test_constant_sequence_has_period_one() -> None:
    assert find_period([7] * 30) == 1


def test_random_sequence_has_no_period() -> None:
    rng = random.Random(0)
    assert find_period([rng.randrange(5) for _ in range(300)]) is None


def test_acf_is_one_at_the_period_and_not_before() -> None:
    seq = [1, 2, 3] * 20
    r = acf(seq, 6)
    assert r[3] > 0.99 and r[6] > 0.99
    assert r[1] < 0.95 and r[2] < 0.95


def test_exact_repetition_rejects_an_almost_periodic_alias() -> None:
    # dominant op with one different op at irregular places: high ACF at many lags, but no
    # lag repeats exactly
    seq = [0] * 60
    for i in (5, 17, 31, 52):
        seq[i] = 1
    assert not repeats_exactly(seq, 12, 3)
    assert find_period(seq, repeats=3) is None


def test_tracker_emits_one_boundary_per_iteration_with_the_iteration_time() -> None:
    pattern = [11, 12, 13]
    tr = PeriodTracker()
    bounds = []
    t = 0.0
    for i in range(40):
        for op in pattern:
            t += 0.1 if i < 30 else 0.2  # iterations get 2x slower from iteration 30
            b = tr.push(op, t)
            if b is not None:
                bounds.append(b)
    assert tr.period == 3
    assert len(bounds) >= 30
    times = [round(b.end - b.start, 6) for b in bounds]
    assert times[0] == 0.3 and times[-1] == 0.6


def test_tracker_ignores_startup_ops_and_recovers_after_a_pattern_change() -> None:
    tr = PeriodTracker()
    seq = [99, 98] + [1, 2] * 20 + [5, 6, 7] * 20
    for i, s in enumerate(seq):
        tr.push(s, float(i))
    assert tr.period == 3
