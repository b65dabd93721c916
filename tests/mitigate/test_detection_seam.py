"""Rank 0's work plan talks to the detector through ``rebalance.Detection``: it reads the
findings at each exchange and asks for the followed straggler's compute test only when the
policy wants one (torch-free decision, no process group)."""

from __future__ import annotations

from typing import Any

import pytest

from stalwart.detect import Monitor
from stalwart.detect.alarms import RECOVER
from stalwart.detect.localize import Finding
from stalwart.mitigate.rebalance import Rebalancer, WindowRow


class _Detector:
    """A ``Detection``: fixed findings, and the steps it was asked to test at."""

    def __init__(self, findings: list[Any]) -> None:
        self._findings = findings
        self.asked: list[int] = []

    @property
    def findings(self) -> list[Any]:
        return self._findings

    def request_recovery_test(self, step: int) -> bool:
        self.asked.append(step)
        return True


@pytest.mark.parametrize("wants", [False, True])
def test_the_plan_asks_for_a_recovery_test_only_when_the_policy_wants_one(wants: bool) -> None:
    det = _Detector(["a finding"])
    reb = Rebalancer(det, micro_batches=8, rank=0, world=4, mode="rebalance")
    seen: list[list[Any]] = []

    def observe(step: int, units: Any, step_s: float, steps: int, findings: list[Any],
                start: int) -> None:
        seen.append(findings)
        assert reb.policy is not None
        reb.policy.wants_recovery_test = wants

    assert reb.policy is not None
    reb.policy.observe = observe  # type: ignore[method-assign]
    rows = [WindowRow(0.01, 0.1, 2) for _ in range(4)]
    assert reb._decide(12, rows) is None
    assert seen == [["a finding"]]
    assert det.asked == ([12] if wants else [])


def test_without_a_detector_the_plan_sees_no_findings() -> None:
    reb = Rebalancer(None, micro_batches=8, rank=0, world=4, mode="rebalance")
    seen: list[list[Any]] = []
    assert reb.policy is not None
    reb.policy.observe = lambda *a: seen.append(a[4])  # type: ignore[method-assign]
    reb.policy.wants_recovery_test = True
    assert reb._decide(12, [WindowRow(0.01, 0.1, 2) for _ in range(4)]) is None
    assert seen == [[]]


def test_the_monitor_is_the_detection_the_plan_asks() -> None:
    mon = Monitor(rank=0, world=1, check_every=1, analysis_thread=False)
    try:
        assert not mon.request_recovery_test(10)  # nothing followed: not taken
        mon.core.apply_verdict(Finding("compute", 30, 34, 1.8, ranks=[2], evidence={
            "compute_test_ratio": {"2": 2.0, "0": 1.0}}), 2)
        assert mon.findings and mon.request_recovery_test(40)
        assert mon.core.pending.action == RECOVER
    finally:
        mon.close()
