"""Following a straggler until it recovers, with recovery at equal load confirmed by a test.

Mechanism: a compute straggler's channel measures its compute per step, which falls when a
plan gives it less work -- and a rank under a CPU quota runs a short burst at nearly full
speed. So its recovery alarm is confirmed by the compute test (the same matmuls on every
rank, ``recovery_test``): below ``recovery_threshold`` it is recovered; otherwise the
recovery is rejected (``RecoveryRejected``), the straggler stays active, and the leader tests
again ``RECHECK`` steps later (doubling to ``RECHECK_MAX``) -- a fault that ends while the plan
is in force is found there even if the channel moves no further. A recovery alarm of the
channel during that wait raises no test of its own (``recovery_level``), so a fault that
ends during the wait is found at the recheck: at most the wait after its end. A straggler
found with no healthy level of its own (the outlier test, the audit) is followed at its
peers' level (``Following.follow_born``).

Layout: ``Following`` owns the followed straggler and everything its recovery needs (the
channel that watches it, that channel's healthy level, a second straggler's channel waiting
for its verdict, the rejected recoveries and the next recheck); ``DecisionCore``
(decision.py) and ``VerdictLog`` (verdicts.py) change it only through its methods.

Guarantees: every rank applies the same recovery verdicts to the same state, so every rank
agrees on the followed straggler; the leader alone schedules rechecks and emits events; the
compute tests a rejected recovery costs are bounded (at most one per ``RECHECK_MAX`` steps once
the wait has doubled).
Cost: a few comparisons per recovery alarm; the compute test's pause only for a compute
straggler (``needs_recovery_test``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from stalwart.detect.evidence import Finding
from stalwart.detect.localize import COMPUTE_MILD
from stalwart.events import Event, RecoveryRejected, StragglerRecovered

RECHECK = 16  # steps after a rejected recovery before the compute test runs again...
RECHECK_MAX = 64  # ...doubling per rejection up to this (one validation pause each)


class Following:
    """The straggler followed until it recovers, on the channel that found it.

    ``leader``: this rank schedules rechecks and emits the recovery events (through
    ``emit``); every other rank applies the same verdicts to the same state."""

    def __init__(self, leader: bool, emit: Callable[[Event], None]) -> None:
        self.leader = leader
        self._emit = emit
        self.active: Finding | None = None  # the straggler being followed
        self.channel = "iteration"  # the channel that found it
        self.healthy: float | None = None  # that channel's level before it
        self.switch_to: tuple[str, float] | None = None  # a second straggler's channel
        self.rejections = 0  # recoveries the compute test rejected (this straggler)
        self.recheck_at: int | None = None  # leader: when to test the straggler again
        self.recover_level = 1.0  # the last recovery alarm's level (a recheck reuses it)

    # ---- what the channels' changes do (DecisionCore.classify) ------------------------------
    def watch(self, channel: str, healthy: float | None) -> None:
        """Follow on ``channel``, whose level before the slowdown was ``healthy``."""
        self.channel, self.healthy = channel, healthy

    def propose(self, channel: str, before: float) -> None:
        """A second straggler on ``channel`` (level ``before``): followed there if its
        verdict confirms a new one (``take_switch``)."""
        self.switch_to = (channel, before)

    def take_switch(self) -> tuple[str, float] | None:
        """The channel a verdict would switch to (cleared: one verdict uses it)."""
        switch_to, self.switch_to = self.switch_to, None
        return switch_to

    def recovery_level(self, after: float, min_shift: float) -> float | None:
        """A speed-up to ``after`` on the followed channel: its level over the healthy one if
        it is back within ``min_shift`` of it, else None. While a rejected recovery's wait
        runs (``recheck_at``) the level is only kept, for the recheck, and None returned: a
        channel that moves during the wait does not test again before the recheck (each test
        a validation pause, each rejection doubling the wait -- a compute straggler on a
        reduced share moves its channel by noise alone, its bursts escaping a CPU quota)."""
        if self.healthy is not None and after <= self.healthy * (1.0 + min_shift):
            self.recover_level = after / self.healthy
            return self.recover_level if self.recheck_at is None else None
        return None

    def recheck_due(self, key: int) -> bool:
        """Leader, nothing under way: whether a rejected recovery's wait ended at ``key``
        (then cleared: the recheck's alarm is raised once)."""
        if self.recheck_at is not None and key >= self.recheck_at:
            self.recheck_at = None
            return True
        return False

    # ---- what a verdict does (VerdictLog.apply) ---------------------------------------------
    def found(self, finding: Finding) -> None:
        """A new verdict: its straggler followed (none for an unexplained slowdown, which has
        no culprit to watch), its recovery's bookkeeping from zero."""
        self.active = finding if finding.kind != "unknown" else None
        self.rejections, self.recheck_at = 0, None

    def follow_born(self, f: Finding, step_s: float) -> None:
        """A straggler found by the outlier test or the audit is followed for its recovery
        at its peers' level, since it has no healthy level of its own: a rank on its own
        relative-compute channel back to 1 (the job's median), a link on the iteration time
        back to the step time ``step_s`` priced without it (``severity``)."""
        if f.kind == "compute" and len(f.ranks) == 1:
            self.watch(f"rank{f.ranks[0]}", 1.0)
        else:
            self.watch("iteration", step_s / max(f.severity, 1.0))

    # ---- recovery ---------------------------------------------------------------------------
    def needs_test(self) -> bool:
        """Whether a recovery alarm must be confirmed by the compute test (every rank asks
        the same state: the verdicts are applied everywhere)."""
        f = self.active
        return f is not None and f.kind == "compute" and len(f.ranks) == 1

    def may_request(self) -> bool:
        """Leader: whether the policy's request for the compute test can be taken now (a
        compute straggler followed, no rejected recovery's wait running)."""
        return self.leader and self.needs_test() and self.recheck_at is None

    def threshold(self) -> float:
        """The compute-test ratio below which the straggler counts as recovered: the
        geometric midpoint between its ratio when it was found and healthy (1.0), at least
        ``COMPUTE_MILD`` (below which the compute test calls no rank slow)."""
        f = self.active
        found = None
        if f is not None and f.ranks:
            found = (f.evidence.get("compute_test_ratio") or {}).get(str(f.ranks[0]))
        if not found or found <= 1.0:
            return COMPUTE_MILD
        return max(COMPUTE_MILD, math.sqrt(float(found)))

    def test(self, ratio: float | None, decided: int) -> bool:
        """Every rank: the compute test's verdict on a recovery alarm (``ratio``: the
        straggler's test time over its peers' median; None = no test ran, believed). On a
        rejection the straggler stays active and the leader schedules the next test
        (``RECHECK`` steps, doubling per rejection up to ``RECHECK_MAX``)."""
        if ratio is None or ratio < self.threshold():
            return True
        f = self.active
        assert f is not None
        self.rejections += 1
        wait = min(RECHECK << (self.rejections - 1), RECHECK_MAX)
        if self.leader:
            self.recheck_at = decided + wait
            self._emit(RecoveryRejected(step=decided, kind=f.kind, ranks=list(f.ranks),
                                        compute_test_ratio=round(ratio, 3),
                                        threshold=round(self.threshold(), 3),
                                        next_check_step=decided + wait))
        return False

    def recovered(self, onset: int, decided: int, level: float,
                  test_ratio: float | None = None) -> None:
        """Every rank: the followed straggler's channel is back to its healthy level (and,
        for a compute straggler, the compute test agreed: ``test_ratio``); a
        ``StragglerRecovered`` through ``emit``."""
        f, self.active = self.active, None
        self.rejections, self.recheck_at = 0, None
        if f is None:
            return
        f.recovered_step = onset
        if f.kind != "unknown":
            fields: dict[str, Any] = {
                "step": decided, "onset_step": onset, "kind": f.kind, "ranks": f.ranks,
                "detected_step": f.step, "detected_onset_step": f.onset_step,
                "severity": round(level, 3)}
            if f.link is not None:
                fields["link"] = f.link
            if test_ratio is not None:
                fields["compute_test_ratio"] = round(test_ratio, 3)
            self._emit(StragglerRecovered(**fields))
