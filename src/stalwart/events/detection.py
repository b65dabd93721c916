"""The detector's verdicts (stalwart.detect): a straggler found, recovered, a recovery the
compute test rejected, a slowdown pinned on no rank or link."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from stalwart.events.base import Event


@dataclass
class StragglerDetected(Event):
    """A validated straggler: a rank (compute, or its host's link) or a link between two."""

    name: ClassVar[str] = "straggler_detected"
    optional: ClassVar[tuple[str, ...]] = ("link",)
    step: int  # decided at
    onset_step: int
    kind: str  # "compute" | "link"
    ranks: list[int]
    severity: float  # iteration-time slowdown factor
    evidence: dict[str, Any] = field(default_factory=dict)
    link: list[int] | None = None


@dataclass
class SlowdownUnexplained(StragglerDetected):
    """A job-wide slowdown that lasted and that validation pinned on no rank or link."""

    name: ClassVar[str] = "slowdown_unexplained"


@dataclass
class StragglerRecovered(Event):
    """The followed straggler's channel is back to within ``min_shift`` of its healthy level."""

    name: ClassVar[str] = "straggler_recovered"
    optional: ClassVar[tuple[str, ...]] = ("link", "compute_test_ratio")
    step: int
    onset_step: int  # of the recovery
    kind: str
    ranks: list[int]
    detected_step: int
    detected_onset_step: int
    severity: float  # level after / healthy level
    link: list[int] | None = None
    # a compute straggler's recovery is confirmed by the compute test at equal load: its time
    # over the peers' median (below ``threshold`` of RecoveryRejected)
    compute_test_ratio: float | None = None


@dataclass
class RecoveryRejected(Event):
    """A compute straggler's channel read healthy, but the compute test at equal load (the
    same work on every rank, whatever share a plan left it) still finds it slow: it stays
    a straggler, and is tested again at ``next_check_step``."""

    name: ClassVar[str] = "recovery_rejected"
    step: int
    kind: str
    ranks: list[int]
    compute_test_ratio: float
    threshold: float
    next_check_step: int
