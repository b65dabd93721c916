"""A slowdown a channel reports while another alarm is decided is not lost: it waits and is
classified after that decision, unless the validation tests already measured it (the
decision state machine's side, torch-free)."""

from __future__ import annotations

from stalwart.detect.alarms import AUDIT, DETECT, NONE, RECOVER, IterSample
from stalwart.detect.changepoint import Change
from stalwart.detect.decision import DecisionCore
from stalwart.detect.localize import Finding


def _following() -> DecisionCore:
    core = DecisionCore(True)
    core.classify(Change(40, 43, 1.0, 2.0), "rank3")  # rank 3's compute over its peers'
    core.take_pending()
    core.alarm_read()
    core.apply_verdict(Finding("compute", 40, 44, 1.8, ranks=[3],
                               evidence={"compute_test_ratio": {"3": 2.0, "0": 1.0}}), 3)
    return core


def test_a_slowdown_during_a_recovery_decision_is_alarmed_once_the_recovery_is_done() -> None:
    core = _following()
    core.classify(Change(70, 80, 2.0, 1.0), "rank3")  # rank 3 back at its healthy level
    assert core.pending.action == RECOVER
    core.take_pending()
    # while the recovery is being decided, the step time rises (a link throttled at 90)
    core.classify(Change(90, 92, 0.05, 0.15), "iteration")
    assert core.pending.action == NONE  # one decision at a time
    core.alarm_read()
    assert core.recovery_test(1.02, decided=93)
    core.apply_recovery(70, 93, 1.0, 1.02)
    core.sample(IterSample(94, 0.15, 0.05, 0.1))
    assert core.pending.action == DETECT and core.pending.onset == 90


def test_a_slowdown_the_validation_measured_is_not_alarmed_again() -> None:
    core = DecisionCore(True)
    core.classify(Change(30, 34, 1.0, 1.6), "rank2")
    core.take_pending()
    core.classify(Change(31, 35, 0.05, 0.08), "iteration")  # the same slowdown, later
    core.classify(Change(37, 39, 1.0, 1.8), "rank1")  # began after the tests ran (36)
    core.alarm_read()
    core.apply_verdict(Finding("unknown", 30, 36, 1.6), 2)  # nothing confirmed
    core.sample(IterSample(40, 0.08, 0.05, 0.03))
    assert core.pending.action == DETECT and core.pending.onset == 37
    core.take_pending()
    core.alarm_read()
    core.apply_verdict(Finding("unknown", 37, 41, 1.6), 1)
    core.sample(IterSample(42, 0.08, 0.05, 0.03))
    assert core.pending.action == NONE  # nothing else waited


def test_the_same_fault_seen_again_after_its_verdict_is_dropped() -> None:
    core = DecisionCore(True)
    core.classify(Change(30, 34, 1.0, 2.0), "rank2")
    core.take_pending()
    core.classify(Change(36, 38, 1.0, 2.0), "rank2")  # the culprit's channel again
    core.alarm_read()
    core.apply_verdict(Finding("compute", 30, 36, 2.0, ranks=[2],
                               evidence={"compute_test_ratio": {"2": 2.0}}), 2)
    core.sample(IterSample(39, 0.1, 0.1, 0.0))
    assert core.pending.action == NONE and core.active is not None


def test_a_host_link_found_again_through_another_of_its_pairs_is_one_straggler() -> None:
    core = DecisionCore(True)
    core.classify(Change(160, 164, 0.05, 0.2), "iteration")
    core.take_pending()
    core.alarm_read()
    core.apply_verdict(Finding("link", 162, 169, 4.0, ranks=[1], link=[0, 1]), None)
    assert len(core.findings) == 1
    core.classify(Change(203, 207, 1.0, 1.5), "rank1")
    core.take_pending()
    core.alarm_read()
    core.apply_verdict(Finding("link", 203, 208, 1.5, ranks=[1], link=[1, 2]), 1)
    assert len(core.findings) == 1 and core.repeats == 1
    # a slow pair between two ranks is another straggler when the pair differs
    core.classify(Change(230, 234, 0.3, 0.5), "iteration")
    core.take_pending()
    core.alarm_read()
    core.apply_verdict(Finding("link", 230, 235, 1.6, ranks=[], link=[2, 3]), None)
    assert len(core.findings) == 2


def test_a_slowdown_that_waited_and_began_before_the_recovery_is_not_found_again() -> None:
    """The straggler's own slowdown seen late by another channel, held while its recovery was
    decided: part of the episode that ended, not a new straggler (seen: rank 1 found at
    1160 with onset 1153, recovered at 1171, found again at 1173 with onset 1153)."""
    core = _following()
    core.classify(Change(70, 80, 2.0, 1.0), "rank3")
    core.take_pending()
    core.classify(Change(42, 81, 0.05, 0.1), "iteration")  # the slowdown, seen late
    core.alarm_read()
    assert core.recovery_test(1.02, decided=82)
    core.apply_recovery(70, 82, 1.0, 1.02)
    core.sample(IterSample(83, 0.05, 0.05, 0.0))
    assert core.pending.action == NONE


def test_a_slowdown_held_during_a_clean_audit_is_alarmed_after_it() -> None:
    """The audit looks for ranks slow all along and judges no change: a change point that
    waited for it is classified once it is done (seen: a 6x rank from step 30, whose change
    waited for the audit at step 44 and was dropped with it, never found)."""
    core = DecisionCore(True)
    for k in range(1, 42):
        core.sample(IterSample(k, 0.03, 0.02, 0.01))
        core.relative(k, [0.02, 0.02])
    assert core.pending.action == AUDIT
    core.take_pending()
    core.classify(Change(30, 40, 0.03, 0.25), "iteration")  # held: the audit is under way
    assert core.pending.action == NONE
    core.alarm_read()
    slow = {"compute_test_ratio": {"0": 1.0, "1": 8.3}}  # what the audit's test read
    core.apply_verdict(Finding("unknown", 1, 44, 1.0, evidence=slow), None, action=AUDIT)
    core.sample(IterSample(45, 0.25, 0.02, 0.23))
    assert core.pending.action == DETECT and core.pending.onset == 30


def test_a_slowdown_held_during_an_audit_that_read_every_rank_healthy_is_let_go() -> None:
    """The held change's own rank read healthy by the audit's compute test: nothing for
    another validation to find (a replayed tuning run: rank 2's noise at step 15, read 1.0x
    at the audit of step 20)."""
    core = DecisionCore(True)
    for k in range(1, 42):
        core.sample(IterSample(k, 0.03, 0.02, 0.01))
        core.relative(k, [0.02, 0.02, 0.02])
    assert core.pending.action == AUDIT
    core.take_pending()
    core.classify(Change(30, 40, 1.0, 1.5), "rank2")
    core.alarm_read()
    healthy = {"compute_test_ratio": {"0": 1.0, "1": 1.05, "2": 1.01}}
    core.apply_verdict(Finding("unknown", 1, 44, 1.0, evidence=healthy), None, action=AUDIT)
    core.sample(IterSample(45, 0.03, 0.02, 0.01))
    assert core.pending.action == NONE


def test_a_later_slowdown_held_during_a_verdict_that_named_nothing_is_alarmed() -> None:
    """A verdict naming nothing judged its own alarm's slowdown only: one that began later
    (beyond the onset slack) and waited is another slowdown; one at the same onset is not."""
    core = DecisionCore(True)
    core.classify(Change(23, 28, 0.03, 0.04), "iteration")
    core.take_pending()
    core.classify(Change(24, 29, 1.0, 1.33), "rank0")  # the same slowdown, another channel
    core.classify(Change(29, 31, 1.0, 8.33), "rank1")  # a later one
    core.alarm_read()
    core.apply_verdict(Finding("unknown", 23, 33, 1.3,
                               evidence={"compute_test_ratio": {"0": 1.0, "1": 8.0}}), None)
    core.sample(IterSample(34, 0.25, 0.02, 0.23))
    assert core.pending.action == DETECT and core.pending.onset == 29
    core.take_pending()
    core.alarm_read()
    core.apply_verdict(Finding("compute", 29, 36, 6.0, ranks=[1],
                               evidence={"compute_test_ratio": {"1": 8.0}}), 1)
    core.sample(IterSample(37, 0.25, 0.02, 0.23))
    assert core.pending.action == NONE  # the onset-24 change was the first verdict's
