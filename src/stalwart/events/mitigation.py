"""Mitigation's actions (stalwart.mitigate): a plan or restart applied, reverted, and its gain
measured against the prediction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stalwart.events.base import Event


@dataclass
class MitigationApplied(Event):
    """A plan or a restart agreed by every rank; ``step`` is where it takes effect."""

    name: ClassVar[str] = "mitigation_applied"
    step: int
    decided_step: int
    strategy: str  # "rebalance" | "exclude_host" | "restore_host" | "remap"
    version: int
    plan: list[int]  # micro-batches per data-parallel group, or the hosts after a restart
    target: str  # "rank3" | "host2" | "hosts"
    predicted_gain: float
    reason: str


@dataclass
class MitigationReverted(Event):
    name: ClassVar[str] = "mitigation_reverted"
    step: int
    decided_step: int
    strategy: str
    version: int
    plan: list[int]
    reason: str


@dataclass
class MitigationMeasured(Event):
    """The step-time gain measured after a switch (or a restart), against its prediction."""

    name: ClassVar[str] = "mitigation_measured"
    step: int
    version: int
    strategy: str
    predicted_gain: float
    measured_gain: float
    step_time_before: float
    step_time_after: float
