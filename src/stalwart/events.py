"""The run directory's events as types: the detector's verdicts and the mitigation's actions.

One dataclass per event; ``fields()`` is the JSON line's content (``events.jsonl`` stays the
format: ``{"event": NAME, "time": ..., **fields}``), ``parse`` reads a line back into its type
(None for an event this module does not type), ``describe`` is the one phrasing of an event
for a person -- the live progress line, a script run's display and the report use it.

Writers: stalwart.detect (``StragglerDetected``, ``StragglerRecovered``,
``RecoveryRejected``, ``SlowdownUnexplained``), stalwart.mitigate (``MitigationApplied``,
``MitigationReverted``, ``MitigationMeasured``), the launcher (``RegroupFailed``,
``RankUnresponsive``).
Torch-free; no I/O (``rundir.EventLog.emit`` writes one).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar


@dataclass
class Event:
    name: ClassVar[str] = ""

    def fields(self) -> dict[str, Any]:
        """The JSON line's fields (an optional field that is None is left out)."""
        d = asdict(self)
        for k in self.optional:
            if d.get(k) is None:
                d.pop(k, None)
        return d

    optional: ClassVar[tuple[str, ...]] = ()


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


@dataclass
class RegroupFailed(Event):
    """An in-place regroup could not be made (mitigate/fallback.py): the launcher fell back to
    ``fallback`` -- "restart" (every rank's state saved, the job relaunched on ``hosts`` from
    ``resume_step``) or "none" (no usable state, or too many fallbacks: the job stops)."""

    name: ClassVar[str] = "regroup_failed"
    optional: ClassVar[tuple[str, ...]] = ("resume_step",)
    step: int  # the launcher's step count when it gave up
    generation: int  # the membership generation that could not be built
    reason: str  # the first rank's own failure
    fallback: str  # "restart" | "none"
    hosts: list[int]  # the membership relaunched on (the generation's hosts, less the dead)
    failed: list[int] = field(default_factory=list)  # launch ranks that failed on their own
    resume_step: int | None = None


@dataclass
class RankUnresponsive(Event):
    """A rank sent no heartbeat past its bound (heartbeat.py): hung or cut off. The launcher
    SIGKILLed it; what follows is a dead rank's path (``rank_lost`` or ``rank_failed``)."""

    name: ClassVar[str] = "rank_unresponsive"
    step: int  # the launcher's step count
    rank: int  # launch rank
    silent_s: float  # seconds since its last beat (or its start, ``heard`` False)
    bound_s: float  # the bound it broke: SILENT_S once set up, START_SILENT_S before
    heard: bool  # it had beaten at least once


TYPES: dict[str, type[Event]] = {t.name: t for t in (
    StragglerDetected, SlowdownUnexplained, StragglerRecovered, RecoveryRejected,
    MitigationApplied,
    MitigationReverted, MitigationMeasured, RegroupFailed, RankUnresponsive)}


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


def _who(ranks: list[int], link: list[int] | None) -> str:
    if ranks:
        who = f"rank {','.join(map(str, ranks))}"
        return who + (f" (link {link[0]}-{link[1]})" if link and len(link) == 2 else "")
    return f"{link[0]}-{link[1]}" if link and len(link) == 2 else f"{link}"


def describe_regroup_failed(rec: dict[str, Any]) -> str:
    """The line for a failed in-place regroup and the fallback taken."""
    hosts = " ".join(str(h) for h in rec.get("hosts") or [])
    if rec.get("fallback") == "restart":
        done = (f"fell back to a checkpoint-and-relaunch on hosts [{hosts}] from step "
                f"{rec.get('resume_step')}")
    else:
        done = "no fallback left: the job stops"
    return (f"in-place regroup failed at step {rec.get('step')} ({rec.get('reason')}); "
            f"{done}")


def describe(rec: dict[str, Any], unit: str = "step") -> str | None:
    """One line for a detector event (``unit``: "step", or "iteration" for a script run whose
    steps are the monitor's iterations); None for the others. Reads the line's fields as they
    are, so a partial line (an older version's) still reads."""
    ev = rec.get("event")
    if ev == SlowdownUnexplained.name:
        return f"job slowed at {unit} {rec.get('step')}, no culprit rank or link found"
    if ev == StragglerDetected.name:
        return (f"straggler: {rec.get('kind')} {_who(rec.get('ranks') or [], rec.get('link'))} "
                f"x{rec.get('severity', 0):.2f} since {unit} {rec.get('onset_step')}")
    if ev == StragglerRecovered.name:
        return f"straggler recovered at {unit} {rec.get('step')}"
    if ev == RegroupFailed.name:
        return describe_regroup_failed(rec)
    if ev == RankUnresponsive.name:
        return (f"rank {rec.get('rank')} sent no heartbeat for {rec.get('silent_s', 0):.1f} s "
                "(hung or cut off); the launcher killed it")
    if ev == RecoveryRejected.name:
        return (f"rank {','.join(map(str, rec.get('ranks') or []))} reads healthy at {unit} "
                f"{rec.get('step')} but is still x{rec.get('compute_test_ratio', 0):.2f} "
                "in the compute test")
    return None
