"""A link found through a rank's own compute channel is followed for its recovery on the
iteration time (``VerdictLog._iteration_level``, verdicts.py): the rank's compute over its
peers' falling back is not the link's recovery; the step time back at its level before the
onset is."""

from __future__ import annotations

from stalwart.detect.alarms import DETECT, NONE, RECOVER, IterSample
from stalwart.detect.changepoint import Change
from stalwart.detect.decision import DecisionCore
from stalwart.detect.localize import Finding


def _link_found_through_rank2() -> DecisionCore:
    core = DecisionCore(True, audit=False)
    for k in range(40):
        core.sample(IterSample(k, 0.1, 0.08, 0.02))
    core.classify(Change(40, 45, 1.0, 1.6), "rank2")
    assert core.pending.action == DETECT
    core.take_pending()
    core.alarm_read()
    core.apply_verdict(Finding("link", 40, 46, 4.0, ranks=[2], link=[1, 2]), 2)
    assert core.active is not None and core.active.kind == "link"
    return core


def test_the_ranks_compute_falling_back_is_not_the_links_recovery() -> None:
    core = _link_found_through_rank2()
    core.classify(Change(48, 50, 1.6, 1.0), "rank2")
    assert core.pending.action == NONE and core.active is not None


def test_the_step_time_back_at_its_level_before_the_onset_is() -> None:
    core = _link_found_through_rank2()
    core.classify(Change(60, 63, 0.4, 0.2), "iteration")  # faster, still 2x the level before
    assert core.pending.action == NONE
    core.classify(Change(70, 73, 0.2, 0.105), "iteration")
    assert core.pending.action == RECOVER


def test_a_compute_straggler_stays_on_its_own_channel() -> None:
    core = DecisionCore(True, audit=False)
    for k in range(40):
        core.sample(IterSample(k, 0.1, 0.08, 0.02))
    core.classify(Change(40, 45, 1.0, 2.0), "rank2")
    core.take_pending()
    core.alarm_read()
    core.apply_verdict(Finding("compute", 40, 46, 1.8, ranks=[2],
                               evidence={"compute_test_ratio": {"2": 2.0, "0": 1.0}}), 2)
    core.classify(Change(60, 63, 2.0, 1.0), "rank2")
    assert core.pending.action == RECOVER
