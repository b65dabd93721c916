"""What a validated verdict does: a straggler logged and followed, a slowdown on probation,
or a hiccup counted.

Mechanism: every rank applies the verdict of every validated alarm (``apply_verdict``) to the
same state. A verdict naming the straggler already followed (``same_straggler``) is a repeat;
one naming a new rank or link becomes the followed straggler and, on the leader, a
``StragglerDetected`` event. Validation is what makes a slowdown a straggler (FALCON): a
verdict naming no rank or link is an unexplained slowdown, logged (``SlowdownUnexplained``)
only if the job's iteration time stays above its level before the onset for ``persist``
samples, by ``min_shift`` in the median and beyond chance in a rank-sum test (``LASTING_Z``);
otherwise, like a verdict the tests did not confirm, it is counted as a hiccup.

Layout: ``VerdictLog`` owns the verdicts' record (the findings, the repeats, the hiccups, the
unexplained slowdown on probation) and is given what it reads: the core's sample history, its
step time and its event sink at construction; the followed straggler (``Following``,
recovery.py), the alarm's outlier and the CUSUM bank with each verdict.

Guarantees: one fault, one finding -- a repeat is counted, not logged; an unexplained slowdown
followed by a culprit becomes a hiccup; bounded memory (the last 16 hiccups are kept).
Cost: a few comparisons per verdict (one per validation pause); a slowdown on probation costs
one median and one rank-sum test of the samples since its decision when it settles.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from stalwart.detect.alarms import AUDIT, DETECT, OUTLIER, IterSample, suspect_of
from stalwart.detect.changepoint import Change
from stalwart.detect.cusum import CusumBank
from stalwart.detect.evidence import Finding
from stalwart.detect.localize import COMPUTE_MILD
from stalwart.detect.onset import BEFORE, ONSET_SLACK
from stalwart.detect.outlier import Outlier
from stalwart.detect.recovery import Following
from stalwart.detect.robust import rank_sum_z
from stalwart.events import Event, SlowdownUnexplained, StragglerDetected

LASTING_Z = 3.0  # an unexplained slowdown is logged only if it lasts beyond chance (p ~ 1e-3)


@dataclass
class _Unexplained:
    fields: dict[str, Any]  # the event it would be logged as
    before: list[float]  # iteration times before its onset
    decided: int


def same_straggler(a: Finding, b: Finding) -> bool:
    """Whether two verdicts name the same straggler: the same kind and ranks, and for a link
    between two ranks (no rank named) the same pair. A host's own link is named by its rank;
    the slowest of its pairs, which the verdict also records, varies from test to test (seen:
    host 1's link found at [0, 1], then again at [1, 2] and logged twice)."""
    return a.kind == b.kind and a.ranks == b.ranks and (bool(a.ranks) or a.link == b.link)


def still_open(change: Change, channel: str, verdict: Finding, action: int) -> bool:
    """Whether a slowdown held (on ``channel``) while ``verdict`` was decided must still be
    classified.

    The tests just looked at every rank and link, so a slowdown that began before they ran
    was in what they measured. A verdict that names a straggler explains everything before
    its step. One that names nothing judged its own alarm's slowdown (from its onset, within
    ``ONSET_SLACK``) -- and, the audit, no change at all (it looks for ranks slow all along):
    a held slowdown it did not judge stays open when the tests read a rank slow that could
    be its cause (the held channel's rank, or any rank for the iteration time: compute test
    >= ``COMPUTE_MILD``); when they read every rank healthy, it is let go like any slowdown
    they measured. Seen: a 6x rank from step 30 of a 2-rank job, whose change point waited
    while the audit ran at step 44 (compute test 8.3x) and was dropped with it: never found
    (CI). A slowdown that began after the tests ran always stays open."""
    if verdict.kind != "unknown" or change.onset >= verdict.step:
        return change.onset >= verdict.step
    if action != AUDIT and change.onset <= verdict.onset_step + ONSET_SLACK:
        return False  # the verdict's own slowdown, seen by another channel
    rank = suspect_of(channel)
    ratios = (verdict.evidence.get("compute_test_ratio") or {}).items()
    return any(float(v) >= COMPUTE_MILD for k, v in ratios if rank < 0 or int(k) == rank)


class VerdictLog:
    """The record of validated verdicts (module docstring).

    ``samples``: the core's iteration history (read only: the level before an onset, the
    times since a decision); ``step_seconds``: the job's recent step time; ``emit``: the
    events' sink; ``persist``, ``min_shift``: how long and by how much an unexplained
    slowdown must last to be logged."""

    def __init__(self, leader: bool, *, persist: int, min_shift: float,
                 samples: deque[IterSample], step_seconds: Callable[[], float],
                 emit: Callable[[Event], None]) -> None:
        self.leader = leader
        self.persist = persist
        self.min_shift = min_shift
        self._samples = samples
        self._step_seconds = step_seconds
        self._emit = emit
        self.findings: list[Finding] = []
        self.count = 0  # validated alarms (each one a validation pause)
        self.repeats = 0  # verdicts that named the active straggler again (not logged)
        self.hiccups = 0
        self.hiccup_log: deque[dict[str, Any]] = deque(maxlen=16)
        self.unexplained_logged = 0
        self.unexplained: _Unexplained | None = None  # on probation

    def apply(self, finding: Finding, suspect: int | None, pause: float, action: int, *,
              follow: Following, outlier: Outlier | None, cusum: CusumBank | None) -> None:
        """Every rank: the validated verdict on an alarm (the same on every rank) recorded,
        and ``follow`` told what it follows next; ``action``: the alarm's (DETECT, OUTLIER or
        AUDIT); ``outlier``: the outlier test that raised it, if one did; ``cusum``: the bank
        whose next alarm on ``suspect`` a verdict makes easier or harder."""
        self.count += 1
        switch_to = follow.take_switch()
        if action == AUDIT and finding.kind == "unknown":
            return  # a clean audit: nothing to report, nothing to follow
        active = follow.active
        if active is not None and (finding.kind == "unknown" or same_straggler(finding, active)):
            # while a straggler is active: its own slowdown seen by a channel that lags (the
            # same verdict again), or nothing the tests confirm -- not a new finding, and the
            # active one stays followed on its channel
            if finding.kind == "unknown":
                self._hiccup("nothing confirmed while a straggler is active",
                             finding.event_fields())
            else:
                self.repeats += 1
            return
        if switch_to is not None:
            follow.watch(*switch_to)
        if action != DETECT and finding.kind != "unknown":
            follow.follow_born(finding, self._step_seconds())
        elif finding.kind not in ("compute", "unknown") and follow.channel != "iteration":
            follow.watch("iteration", self._iteration_level(finding))
        self.findings.append(finding)
        follow.found(finding)
        if self.leader:
            self._report(finding, suspect, pause, action, outlier, cusum)

    def _seconds_before(self, onset: int) -> list[float]:
        """The iteration times of the ``BEFORE`` steps before ``onset`` (the level a
        slowdown is measured against)."""
        return [x.seconds for x in self._samples if onset - BEFORE <= x.key < onset]

    def _iteration_level(self, finding: Finding) -> float:
        """The iteration time a link found through a rank's own compute channel is followed
        back to: its level before the onset. Why not that rank's channel: a slow link moves
        its ranks' compute over their peers' only by chance (waits that land in the compute
        window), and that ratio falling back says nothing about the link -- it once reported
        a 10 Mbit/s host link recovered three steps after it was found, the fault still
        on."""
        before = self._seconds_before(finding.onset_step)
        return (statistics.median(before) if before
                else self._step_seconds() / max(finding.severity, 1.0))

    def _report(self, finding: Finding, suspect: int | None, pause: float, action: int,
                outlier: Outlier | None, cusum: CusumBank | None) -> None:
        """Leader: a new verdict logged (a straggler), followed (an unexplained slowdown
        until it proves it lasts) or counted (a hiccup)."""
        fields = finding.event_fields()
        fields["evidence"] = dict(fields["evidence"], validation_s=pause)
        if outlier is not None:
            fields["evidence"]["outlier_test"] = {
                "rank": outlier.rank, "above": outlier.count, "of": outlier.n,
                "p": float(f"{outlier.p:.3g}"), "level": round(outlier.level, 3)}
        if suspect is not None and cusum is not None and action == DETECT:
            # a rank's own channel pointed at it: an alarm the tests did not confirm makes
            # that rank's next CUSUM alarm need more evidence (bounded validation pauses)
            if finding.kind == "compute" and finding.ranks == [suspect]:
                cusum.confirmed(suspect)
            else:
                cusum.unconfirmed(suspect)
        if finding.kind == "unknown" and suspect is not None:
            # one rank's compute moved relative to its peers and the tests found nothing
            # (load from elsewhere shifting CPU shares, or a rank that is not slow now): not
            # a job-wide slowdown to report, a hiccup
            what = "stood out" if action == OUTLIER else "rose"
            self._hiccup(f"rank {suspect}'s compute {what}; the compute test did not confirm "
                         "it", fields)
            return
        if finding.kind == "unknown":
            # Validation is what makes a slowdown a straggler (FALCON): when it names no rank
            # or link, the job as a whole slowed (load from elsewhere) or something passed
            # (an OS hiccup, a fault already gone). Only a slowdown that lasts is logged.
            if self.unexplained is None:
                # the iteration time before the onset (the channel that fired may be a
                # per-rank ratio): what the job's speed must stay above to count as lasting
                before = self._seconds_before(finding.onset_step)
                self.unexplained = _Unexplained(fields, before, finding.step)
            return
        if self.unexplained is not None:
            # a culprit was found after all: the earlier slowdown was its start or a hiccup
            self._hiccup("unexplained slowdown, then a culprit found", self.unexplained.fields)
            self.unexplained = None
        self._emit(StragglerDetected(**fields))

    def close(self) -> None:
        """The run ended: settle an unexplained slowdown still waiting to prove it lasts."""
        if self.unexplained is not None:
            last = self._samples[-1].key if self._samples else self.unexplained.decided
            self.settle(last, final=True)

    def settle(self, key: int, final: bool = False) -> None:
        """Leader, an unexplained slowdown on probation: log it if it lasted, count it if it
        did not (at ``persist`` samples after its decision, or ``final``: the run ended).

        Validation found no culprit; whether the job as a whole stays slower is what tells a
        real job-wide slowdown (load from elsewhere) from an OS hiccup of a few steps: the
        iteration times since the decision must be above those before the onset by
        ``min_shift`` in the median and beyond chance in their ranks (a level ratio alone swung
        by 10-30% on a machine whose step time swings 17-48 ms from step to step).
        """
        u = self.unexplained
        assert u is not None
        if key - u.decided < self.persist and not final:
            return
        self.unexplained = None
        after = [x.seconds for x in self._samples if u.decided < x.key <= key]
        healthy = statistics.median(u.before) if u.before else math.inf
        ratio = statistics.median(after) / healthy if after else 0.0
        z = rank_sum_z(np.asarray(u.before), np.asarray(after))
        lasting = ratio >= 1.0 + self.min_shift and z >= LASTING_Z
        fields = u.fields
        if lasting and key - u.decided >= self.persist:
            self.unexplained_logged += 1
            fields["evidence"] = dict(fields["evidence"],
                                      persisted_steps=key - fields["onset_step"],
                                      level_ratio=round(ratio, 3), rank_sum_z=round(z, 2))
            self._emit(SlowdownUnexplained(**fields))
        else:
            self._hiccup("job-wide slowdown that did not last", fields)

    def _hiccup(self, why: str, fields: dict[str, Any]) -> None:
        self.hiccups += 1
        self.hiccup_log.append({"why": why, **{k: fields.get(k) for k in (
            "step", "onset_step", "severity", "evidence")}})
