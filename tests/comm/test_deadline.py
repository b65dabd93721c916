"""Deadlines adapt to the observed phase time, are agreed by median, and are capped."""

from __future__ import annotations

from stalwart.comm.deadline import AdaptiveDeadline


def test_proposal_projects_the_full_phase_time_with_margin() -> None:
    d = AdaptiveDeadline(floor=0.01, cap=10.0, margin=2.0)
    # half the packets in 0.3 s -> the whole phase would take 0.6 s -> propose 1.2 s
    assert abs(d.observe(0, elapsed=0.3, completion=0.5) - 1.2) < 1e-9
    assert abs(d.current() - 1.2) < 1e-9


def test_agreement_is_the_median_so_one_outlier_cannot_stretch_it() -> None:
    d = AdaptiveDeadline(floor=0.01, cap=100.0)
    d.observe(0, 0.1, 1.0)  # 0.2
    d.hear(1, 0.3)
    d.hear(2, 50.0)  # a slow or hostile peer
    assert abs(d.current() - 0.3) < 1e-9


def test_deadline_is_capped_and_floored() -> None:
    d = AdaptiveDeadline(floor=0.25, cap=2.0)
    d.hear(1, 1e6)
    d.hear(2, 1e6)
    assert d.current() == 2.0
    d2 = AdaptiveDeadline(floor=0.25, cap=2.0)
    d2.observe(0, 1e-4, 1.0)
    assert d2.current() == 0.25


def test_nothing_arrived_backs_off_up_to_the_cap() -> None:
    d = AdaptiveDeadline(initial=0.5, floor=0.1, cap=3.0)
    seen = [d.observe(0, 0.5, 0.0) for _ in range(5)]
    assert seen == sorted(seen) and seen[-1] == 3.0


def test_one_fast_phase_does_not_shrink_the_deadline_below_recent_slow_ones() -> None:
    d = AdaptiveDeadline(floor=0.01, cap=10.0, margin=2.0)
    d.observe(0, 0.5, 1.0)  # a slow phase (machine busy)
    assert abs(d.observe(0, 0.05, 1.0) - 1.0) < 1e-9  # still 2 x the slow one
