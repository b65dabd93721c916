"""A compute straggler's recovery is judged by the compute test at equal load, not by its
channel (which reads healthy when a plan leaves the rank little work): the decision state
machine's side, torch-free."""

from __future__ import annotations

from stalwart.detect.alarms import RECOVER, IterSample
from stalwart.detect.changepoint import Change
from stalwart.detect.decision import DecisionCore
from stalwart.detect.localize import COMPUTE_MILD, Finding
from stalwart.detect.recovery import RECHECK, RECHECK_MAX


def _following(ratio_found: float = 2.0) -> tuple[DecisionCore, list]:
    out: list = []
    core = DecisionCore(True, emit=out.append)
    f = Finding("compute", 30, 34, 1.8, ranks=[2],
                evidence={"compute_test_ratio": {"2": ratio_found, "0": 1.0}})
    core.apply_verdict(f, 2)
    out.clear()
    return core, out


def test_the_threshold_is_the_midpoint_to_the_level_found_at_least_mild() -> None:
    core, _ = _following(4.0)
    assert core.recovery_threshold() == 2.0
    core, _ = _following(1.2)
    assert core.recovery_threshold() == COMPUTE_MILD


def test_a_recovery_the_compute_test_rejects_keeps_the_straggler_and_backs_off() -> None:
    core, out = _following(2.0)
    assert core.needs_recovery_test()
    assert not core.recovery_test(1.9, decided=40)  # still slow at equal load
    assert core.active is not None and out[-1].name == "recovery_rejected"
    assert out[-1].next_check_step == 40 + RECHECK
    # the leader tests again at the scheduled step, without any channel moving
    for k in range(41, 40 + RECHECK):
        core.sample(IterSample(k, 0.1, 0.08, 0.02))
        assert core.pending.action != RECOVER
    core.sample(IterSample(40 + RECHECK, 0.1, 0.08, 0.02))
    assert core.take_pending().action == RECOVER
    core.alarm_read()
    assert not core.recovery_test(1.9, decided=60)
    assert out[-1].next_check_step == 60 + 2 * RECHECK
    for d in (80, 120, 200):
        assert not core.recovery_test(1.9, decided=d)
    assert out[-1].next_check_step - 200 == RECHECK_MAX  # bounded


def test_a_channel_recovery_during_the_backoff_waits_for_the_recheck() -> None:
    """A followed channel that reads healthy again while a rejected recovery's wait runs
    raises no test of its own (each would double the wait: the revert of a fault that ended
    during it could then come after the job ends); the recheck at the scheduled step tests
    it, with the level the channel read."""
    core, out = _following(2.0)
    core.follow.watch("rank2", 0.1)  # the channel that found it, at its healthy level
    assert not core.recovery_test(1.9, decided=40)
    core.classify(Change(onset=44, decided=46, before=0.3, after=0.1), channel="rank2")
    assert core.pending.action != RECOVER  # waits for the recheck
    for k in range(47, 40 + RECHECK):
        core.sample(IterSample(k, 0.1, 0.08, 0.02))
        assert core.pending.action != RECOVER
    core.sample(IterSample(40 + RECHECK, 0.1, 0.08, 0.02))
    alarm = core.take_pending()
    assert alarm.action == RECOVER and alarm.severity == 1.0  # the level the channel read
    core.alarm_read()
    assert core.recovery_test(1.02, decided=40 + RECHECK)
    assert [e.name for e in out] == ["recovery_rejected"]  # one test during the wait


def test_a_recovery_the_compute_test_confirms_is_logged_with_its_ratio() -> None:
    core, out = _following(2.0)
    assert core.recovery_test(1.02, decided=50)
    core.apply_recovery(48, 50, 1.0, 1.02)
    assert core.active is None and out[-1].name == "straggler_recovered"
    assert out[-1].compute_test_ratio == 1.02


def test_the_policy_can_ask_for_a_test_but_not_during_a_backoff() -> None:
    core, out = _following(2.0)
    assert core.request_recovery_test(42)
    assert core.take_pending().action == RECOVER
    core.alarm_read()
    assert not core.recovery_test(2.1, decided=43)
    assert not core.request_recovery_test(44)  # the rejected recovery's wait runs
    healthy = DecisionCore(True)
    assert not healthy.request_recovery_test(44)  # nothing to recover from


def test_an_added_sink_gets_each_event_before_the_constructors() -> None:
    order: list[str] = []
    core = DecisionCore(True, emit=lambda ev: order.append(f"emit {ev.name}"))
    core.add_sink(lambda ev: order.append(f"added {ev.name}"))
    core.apply_verdict(Finding("compute", 30, 34, 1.8, ranks=[2],
                               evidence={"compute_test_ratio": {"2": 2.0, "0": 1.0}}), 2)
    assert order and len(order) % 2 == 0
    assert [o.split()[0] for o in order] == ["added", "emit"] * (len(order) // 2)
    assert order[0].split()[1] == order[1].split()[1]
