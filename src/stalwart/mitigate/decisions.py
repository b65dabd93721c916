"""What rank 0's policy decides: a plan (micro-batch counts per group) or a restart.

Torch-free: the policy, a replay of recorded runs and the simulator build these; the agreement
channel (agreement.py) carries them to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# decision kinds on the wire
NONE, REBALANCE, REVERT, EXCLUDE, RESTORE, REMAP = 0, 1, 2, 3, 4, 5
KIND_NAMES = {REBALANCE: "rebalance", REVERT: "revert", EXCLUDE: "exclude_host",
              RESTORE: "restore_host", REMAP: "remap"}


@dataclass
class Decision:
    """What rank 0 decided: a plan (micro-batch counts per data-parallel group) or a restart."""

    kind: int
    version: int
    start_step: int
    counts: list[int] = field(default_factory=list)
    target: int = -1  # the group (rebalance) or host (exclude/restore) it is about
    predicted_gain: float = 0.0
    reason: str = ""  # rank 0 only: it does not travel (the event log is rank 0's)
    hosts: list[int] = field(default_factory=list)  # rank 0 only: a remap's rank -> host map

    @property
    def name(self) -> str:
        return KIND_NAMES.get(self.kind, "none")
