"""The decision code's vocabulary: alarm actions, the alarm a row carries, an iteration sample.

Mechanism: plain values shared by the state machine (decision.py), the monitor and exchange
that carry its alarms between ranks, replay and the simulator: the actions an alarm can ask
for, which of them the validation tests judge (``DETECTS``) and in which ``localize.decide``
mode (``MODES``), and the channel naming that ties a per-rank channel to its rank.
Guarantees: immutable values (named tuples, constants), the same on every rank.
Cost: none beyond the tuples themselves.
"""

from __future__ import annotations

from typing import NamedTuple

from stalwart.detect.localize import AUDIT_MODE, CHANGE_MODE, OUTLIER_MODE

# alarm actions: a change point (DETECT), the followed straggler's recovery (RECOVER), a rank
# slower than its peers all along (OUTLIER, outlier.py), the one scheduled audit (AUDIT)
NONE, DETECT, RECOVER, OUTLIER, AUDIT = 0, 1, 2, 3, 4
DETECTS = (DETECT, OUTLIER, AUDIT)  # the actions validated by the tests
MODES = {DETECT: CHANGE_MODE, OUTLIER: OUTLIER_MODE, AUDIT: AUDIT_MODE}  # localize.decide's


class IterSample(NamedTuple):
    """One iteration of one rank: its key (step, or iteration index) and seconds."""

    key: int
    seconds: float
    compute: float | None
    comm: float | None


class Alarm(NamedTuple):
    """Rank 0's decision on its way to every rank (the row header carries it)."""

    action: int  # NONE | DETECT | RECOVER
    onset: int
    severity: float
    suspect: int  # the rank whose own channel fired; -1 for the iteration channel


QUIET = Alarm(NONE, 0, 0.0, -1)


def suspect_of(channel: str) -> int:
    """The rank a per-rank channel ("rank3") points at; -1 for the iteration-time channel."""
    return int(channel[4:]) if channel.startswith("rank") else -1
