"""Forward error protection sized to the measured loss (copies.py)."""

from __future__ import annotations

import numpy as np

from stalwart.comm import fec
from stalwart.comm.copies import CLEAN_MIN_OWED, MIN_OWED, CopyPolicy, LossEstimator, copies_for


def test_copies_for_is_the_fewest_that_reach_the_target() -> None:
    assert copies_for(0.0, 1e-3, 4) == 1
    assert copies_for(0.001, 1e-3, 4) == 1
    assert copies_for(0.01, 1e-3, 4) == 2
    assert copies_for(0.05, 1e-3, 4) == 3
    assert copies_for(0.1, 1e-3, 4) == 3  # 0.1**3 == 1e-3 exactly: no float round-up to 4
    assert copies_for(0.3, 1e-3, 4) == 4  # capped
    assert copies_for(1.0, 1e-3, 4) == 4
    cs = [copies_for(float(p), 1e-3, 4) for p in np.linspace(0, 1, 101)]
    assert cs == sorted(cs) and min(cs) >= 1 and max(cs) <= 4


def test_loss_estimator_measures_the_rate_of_missing_datagrams() -> None:
    rng = np.random.default_rng(0)
    est = LossEstimator(world=3)
    assert est.loss(1) is None  # nothing owed yet: no estimate
    for _ in range(100):  # per phase 200 chunks x 2 copies; peer 1 loses 1%, peer 2 none
        for _ in range(400):
            if rng.random() >= 0.01:
                est.arrived(1)
            est.arrived(2)
        est.owe(1, 400)
        est.owe(2, 400)
    assert est.owed[1] >= MIN_OWED
    # 1% is measured (an upper estimate: never below the rate, a little above it), and a
    # clean link reads ~1/owed: low enough for 1 copy at the default 0.1% target
    assert 0.01 < est.loss(1) < 0.02
    assert est.loss(2) < 0.001


def test_a_clean_link_reports_zero_and_one_lost_datagram_turns_the_report_on() -> None:
    est = LossEstimator(world=2)
    assert est.report(1) is None  # nothing owed yet
    for ph in range(40):  # 40 phases of 300 datagrams, all arrived
        est.arrived(1, ph, 300)
        est.owe(1, 300, ph)
        if est.owed[1] < CLEAN_MIN_OWED:  # a small window proves nothing: upper estimate
            assert est.report(1) == est.loss(1) and est.report(1) > 0
    assert est.report(1) == 0.0  # clean: the sender sends this link no parity
    assert fec.plan(1000, est.report(1), 2e-5) is None
    est.arrived(1, 40, 299)  # one datagram lost
    est.owe(1, 300, 40)
    first = est.report(1)
    assert first == est.loss(1) and first > 0  # the upper estimate, as before
    assert fec.plan(1000, first, 2e-5) is not None
    # the lost datagram keeps the link reporting loss for ~6,800 more datagrams (CLEAN_LOST)
    clean_after = None
    for ph in range(41, 100):
        est.arrived(1, ph, 300)
        est.owe(1, 300, ph)
        if clean_after is None and est.report(1) == 0.0:
            clean_after = (ph - 40) * 300
    assert clean_after is not None and 6000 <= clean_after <= 7500, clean_after


def test_policy_starts_at_initial_and_follows_feedback() -> None:
    pol = CopyPolicy(world=3, initial=2, target=1e-3)
    assert pol.copies(1) == 2  # not measured yet
    pol.feedback(1, 0.10)  # the peer sees 10% loss from us
    pol.feedback(2, 0.0)
    assert pol.copies(1) == 3 and pol.copies(2) == 1
    pol.feedback(1, 6.5535)  # out of range (a broken peer): ignored
    assert pol.copies(1) == 3
    floored = CopyPolicy(world=3, initial=2, target=1e-3, min_copies=2)
    floored.feedback(1, 0.0)
    assert floored.copies(1) == 2  # never below the floor
    fixed = CopyPolicy(world=3, initial=2, target=None)
    fixed.feedback(1, 0.0)
    assert fixed.copies(1) == 2 and not fixed.adaptive
