"""Following a straggler until it recovers, with recovery at equal load confirmed by a test.

Mechanism: a compute straggler's channel measures its compute per step, which falls when a
plan gives it less work -- and a rank under a CPU quota runs a short burst at nearly full
speed. So its recovery alarm is confirmed by the compute test (the same matmuls on every
rank, ``recovery_test``): below ``recovery_threshold`` it is recovered; otherwise the
recovery is rejected (``RecoveryRejected``), the straggler stays active, and the leader tests
again ``RECHECK`` steps later (doubling to ``RECHECK_MAX``) -- a fault that ends while the plan
is in force is found there even if the channel moves no further. A straggler found with no
healthy level of its own (the outlier test, the audit) is followed at its peers' level
(``_follow_born``).

Guarantees: every rank applies the same recovery verdicts to the same state, so every rank
agrees on the followed straggler; the leader alone schedules rechecks and emits events; the
compute tests a rejected recovery costs are bounded (at most one per ``RECHECK_MAX`` steps once
the wait has doubled).
Cost: a few comparisons per recovery alarm; the compute test's pause only for a compute
straggler (``needs_recovery_test``).
"""

from __future__ import annotations

import math
from typing import Any

from stalwart.detect.alarms import NONE, RECOVER, Alarm
from stalwart.detect.changepoint import Change
from stalwart.detect.evidence import Finding
from stalwart.detect.localize import COMPUTE_MILD
from stalwart.events import RecoveryRejected, StragglerRecovered

RECHECK = 16  # steps after a rejected recovery before the compute test runs again...
RECHECK_MAX = 64  # ...doubling per rejection up to this (one validation pause each)


class RecoveryMixin:
    """``DecisionCore``'s recovery half: the state below is built by ``DecisionCore``
    (decision.py), whose ``step_seconds`` and ``_emit`` it calls."""

    leader: bool
    active: Finding | None
    pending: Alarm
    deciding: int
    rejections: int
    _recheck_at: int | None
    _recover_level: float
    _channel: str
    _healthy: float | None
    _deferred: list[tuple[Change, str]]

    def needs_recovery_test(self) -> bool:
        """Whether a recovery alarm must be confirmed by the compute test (every rank asks
        the same state: the verdicts are applied everywhere)."""
        f = self.active
        return f is not None and f.kind == "compute" and len(f.ranks) == 1

    def request_recovery_test(self, key: int) -> bool:
        """Leader: the mitigation policy sees the followed compute straggler healthy on the
        reduced share its plan gave it, and asks for the compute test (a recovery alarm now).
        Ignored while a decision is under way or a rejected recovery's wait
        (``RECHECK``..``RECHECK_MAX``) runs: the tests' pauses stay bounded."""
        if (not self.leader or not self.needs_recovery_test() or self._recheck_at is not None
                or self.pending.action != NONE or self.deciding):
            return False
        self.pending = Alarm(RECOVER, key, self._recover_level, -1)
        return True

    def recovery_threshold(self) -> float:
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

    def recovery_test(self, ratio: float | None, decided: int) -> bool:
        """Every rank: the compute test's verdict on a recovery alarm (``ratio``: the
        straggler's test time over its peers' median; None = no test ran, believed). On a
        rejection the straggler stays active and the leader schedules the next test."""
        if ratio is None or ratio < self.recovery_threshold():
            return True
        f = self.active
        assert f is not None
        self.rejections += 1
        wait = min(RECHECK << (self.rejections - 1), RECHECK_MAX)
        if self.leader:
            self._recheck_at = decided + wait
            self._emit(RecoveryRejected(step=decided, kind=f.kind, ranks=list(f.ranks),
                                        compute_test_ratio=round(ratio, 3),
                                        threshold=round(self.recovery_threshold(), 3),
                                        next_check_step=decided + wait))
        return False

    def _follow_born(self, f: Finding) -> None:
        """A straggler found by the outlier test or the audit is followed for its recovery
        at its peers' level, since it has no healthy level of its own: a rank on its own
        relative-compute channel back to 1 (the job's median), a link on the iteration time
        back to the step time priced without it (``severity``)."""
        if f.kind == "compute" and len(f.ranks) == 1:
            self._channel, self._healthy = f"rank{f.ranks[0]}", 1.0
        else:
            self._channel = "iteration"
            self._healthy = self.step_seconds() / max(f.severity, 1.0)

    def apply_recovery(self, onset: int, decided: int, level: float,
                       test_ratio: float | None = None) -> None:
        """Every rank: the followed straggler's channel is back to its healthy level (and,
        for a compute straggler, the compute test agreed: ``test_ratio``)."""
        f, self.active = self.active, None
        self.rejections, self._recheck_at = 0, None
        # a slowdown that waited and began before this recovery was part of the straggler's
        # episode (another channel seeing it late): not a new one to look at
        self._deferred = [(c, n) for c, n in self._deferred if c.onset > onset]
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

