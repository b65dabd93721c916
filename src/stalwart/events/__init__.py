"""The run directory's events as types: every kind a run writes to ``events.jsonl``.

One dataclass per event; ``fields()`` is the JSON line's content (``events.jsonl`` stays the
format: ``{"event": NAME, "time": ..., **fields}``, the fields in their declared order, an
optional field that is None left out), ``parse`` reads a line back into its type (None for a
kind this module does not type or a malformed line), ``describe`` is the one phrasing of an
event for a person -- the live progress line, a script run's display and the report use it.

Writers: stalwart.detect (``StragglerDetected``, ``StragglerRecovered``, ``RecoveryRejected``,
``SlowdownUnexplained``), stalwart.mitigate (``MitigationApplied``, ``MitigationReverted``,
``MitigationMeasured``), the launcher (launch.py, supervise.py, rankexits.py: ``RunStarted``,
``RunFinished``, ``Restart``, ``RankLost``, ``RankFailed``, ``RankLeft``, ``RankRejoining``,
``RankReady``, ``RankRestarted``, ``RejoinFailed``, ``HostProbed``, ``StoreLost``,
``RegroupFailed``, ``RankUnresponsive``), rank 0 of a training job (train/: ``Devices``,
``Resumed``, ``Eval``, ``Checkpoint``, ``Regroup``, ``Halted``, ``RunFinished``), the testbed
(``FaultApplied``, ``FaultRemoved``, ``TestbedPlacement``, ``TestbedCpuCap``,
``TestbedTraffic``), the overlap trainer (``OverlapPlan``), the simulator (``FaultDrawn``) and
the torchft peer (``TorchftQuorum``, ``Eval``). A simulated run's scenario records (simulate/
engine.py: the live kinds' names with the simulator's own fields) are relayed as they are
(``rundir.EventLog.relay``) and are not these types.
The types live by domain: ``detection`` (the detector's verdicts), ``mitigation`` (its
actions), ``membership`` (ranks, regroups, the store, the torchft quorum), ``run`` (the run's
life and rank 0's lines), ``faults`` (the testbed's ground truth, the simulator's draws);
``registry`` names them (``TYPES``, ``parse``), ``phrases`` words them (``describe``). Import
them from ``stalwart.events``, which re-exports every one.
Torch-free; no I/O (``rundir.EventLog.emit`` writes one).
"""

from __future__ import annotations

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
from stalwart.events.phrases import describe, describe_regroup_failed
from stalwart.events.registry import TYPES, parse
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

__all__ = [
    "TYPES", "Checkpoint", "Devices", "Eval", "Event", "FaultApplied", "FaultDrawn",
    "FaultRemoved", "Halted", "HostProbed", "MitigationApplied", "MitigationMeasured",
    "MitigationReverted", "OverlapPlan", "RankFailed", "RankLeft", "RankLost", "RankReady",
    "RankRejoining", "RankRestarted", "RankUnresponsive", "RecoveryRejected", "Regroup",
    "RegroupFailed", "RejoinFailed", "Restart", "Resumed", "RunFinished", "RunStarted",
    "SlowdownUnexplained", "StoreLost", "StragglerDetected", "StragglerRecovered",
    "TestbedCpuCap", "TestbedPlacement", "TestbedTraffic", "TorchftQuorum", "describe",
    "describe_regroup_failed", "parse",
]
