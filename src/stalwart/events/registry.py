"""Every event type by its name, and a JSON line read back into its type. Torch-free, no I/O."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from stalwart.events.base import Event
from stalwart.events.detection import (
    RecoveryRejected,
    SlowdownUnexplained,
    StragglerDetected,
    StragglerRecovered,
)
from stalwart.events.faults import (
    FaultApplied,
    FaultDrawn,
    FaultRemoved,
    TestbedCpuCap,
    TestbedPlacement,
    TestbedTraffic,
)
from stalwart.events.membership import (
    HostProbed,
    RankFailed,
    RankLeft,
    RankLost,
    RankReady,
    RankRejoining,
    RankRestarted,
    RankUnresponsive,
    Regroup,
    RegroupFailed,
    RejoinFailed,
    StoreLost,
    TorchftQuorum,
)
from stalwart.events.mitigation import MitigationApplied, MitigationMeasured, MitigationReverted
from stalwart.events.run import (
    Checkpoint,
    Devices,
    Eval,
    Halted,
    OverlapPlan,
    Restart,
    Resumed,
    RunFinished,
    RunStarted,
)

TYPES: dict[str, type[Event]] = {t.name: t for t in (
    StragglerDetected, SlowdownUnexplained, StragglerRecovered, RecoveryRejected,
    MitigationApplied, MitigationReverted, MitigationMeasured, RegroupFailed, RankUnresponsive,
    RunStarted, RunFinished, Devices, Resumed, Eval, Checkpoint, Halted, Restart,
    RankLost, RankFailed, RankLeft, RankRejoining, RankReady, RankRestarted, RejoinFailed,
    HostProbed, StoreLost, Regroup, FaultApplied, FaultRemoved, TestbedPlacement, TestbedCpuCap,
    TestbedTraffic, OverlapPlan, FaultDrawn, TorchftQuorum)}


def parse(rec: dict[str, Any]) -> Event | None:
    """The typed event of a JSON line; None for an event not typed here or a malformed one."""
    t = TYPES.get(str(rec.get("event")))
    if t is None:
        return None
    names = {f.name for f in fields(t)}
    try:
        return t(**{k: v for k, v in rec.items() if k in names})
    except TypeError:  # a required field is missing: a line from an older version
        return None
