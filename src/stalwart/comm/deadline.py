"""Adaptive, agreed, capped phase deadlines -- deadlines instead of retransmissions.

Mechanism: OptiReduce's bounded-time transport (NSDI '25) as used by "Distributed Training
under Packet Loss". A phase ends as soon as every expected packet arrived, or every live sender's
end-of-phase marker arrived plus a short grace (5% of the elapsed time, at least ``min_grace``),
or at the hard deadline -- whichever comes first. Nothing is ever retransmitted.

The hard deadline adapts: after each phase a rank proposes ``margin * elapsed / completion``
(the time the whole phase would have taken at the observed rate; the largest of the last
``HISTORY`` phases), clipped to [floor, cap]. The
proposal travels in every end-of-phase marker's ``hint``; each rank uses the median of the
latest proposals it holds (its own and its peers'), so ranks agree without a reliable channel
and one rank's outlier cannot stretch everybody's deadline. The cap bounds what a silent rank
can cost: one deadline, after which it is not waited for until it speaks again.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

HISTORY = 8  # phases remembered for the proposal


@dataclass
class AdaptiveDeadline:
    initial: float = 2.0  # seconds, before anything was measured (start-up skew is large)
    # Never below this: a phase's clock starts when THIS rank enters it, so the deadline must
    # also absorb compute skew between ranks, which the completion rate cannot see. Only a
    # late or silent rank (or all copies of an end marker lost) ever makes a phase wait this.
    # 1 s, not less: the skew that matters comes from the job's other traffic on TCP (eval,
    # checkpoint barriers, the monitor), which under loss stalls ranks for 0.2-1 s on
    # retransmission timeouts; at 0.25 s every such stall cost a whole rank's contribution.
    floor: float = 1.0
    cap: float = 5.0
    margin: float = 2.0  # headroom over the projected full-phase time
    min_grace: float = 0.001
    grace_frac: float = 0.05
    proposals: dict[int, float] = field(default_factory=dict)  # rank -> latest proposal (s)
    _recent: list[float] = field(default_factory=list)  # this rank's projected phase times

    def current(self) -> float:
        """The agreed hard deadline for the next phase (seconds after it starts)."""
        if not self.proposals:
            return min(max(self.initial, self.floor), self.cap)
        return min(max(statistics.median(self.proposals.values()), self.floor), self.cap)

    def observe(self, me: int, elapsed: float, completion: float) -> float:
        """Record this rank's phase outcome; returns its new proposal (seconds)."""
        if completion > 0:
            # the slowest of the recent phases, not the last one: phase times on a shared
            # machine jump by 2x from one step to the next, and a deadline that fires on a
            # healthy phase turns every packet still in flight into a loss
            self._recent.append(elapsed / min(completion, 1.0))
            del self._recent[:-HISTORY]
            prop = min(max(self.margin * max(self._recent), self.floor), self.cap)
        else:  # nothing arrived: the deadline was too short or everyone is silent; back off
            prop = min(max(2 * self.current(), self.floor), self.cap)
        self.proposals[me] = prop
        return prop

    def hear(self, rank: int, proposal_s: float) -> None:
        if proposal_s > 0:
            self.proposals[rank] = min(max(proposal_s, self.floor), self.cap)

    def grace(self, elapsed: float) -> float:
        return max(self.min_grace, self.grace_frac * elapsed)
