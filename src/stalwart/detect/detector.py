"""The one decision path: samples in, events out, validation evidence behind one interface.

``Detector`` is what the live monitor, replay and the simulator drive. It holds the decision
state machine (``DecisionCore``, decision.py) and an ``EvidenceSource``: whatever measures the
validation tests when an alarm arrives -- live, the torch collectives every rank runs
(``verify.LiveEvidence``); in replay, the raw rounds the run directory recorded
(``stalwart.replay.RecordedEvidence``); in the simulator, rounds drawn from measured noise
(``stalwart.simulate.decide.SimEvidence``). The rules -- how many compute rounds a mild
suspect needs (``localize.more_rounds``), the round-robin link pairs when the ring explains
nothing, the verdict (``localize.decide``: onset, localisation, audit), what a verdict does
(verdicts.py) and a recovery (recovery.py) -- run here, the same for all three.

One step (``Detector.step``, a ``StepInput``): the samples of steps held since the last one
(the monitor's batched checks; each as a step with nothing else), the leader's iteration
sample, then the rows
read back this step (every rank's compute at their steps: the per-rank channels), then the
alarm raised so far, which the caller sends with its next row (``StepOutput.send``), and last
the alarm the rows read now carried -- validated through the source and applied. This is the
live exchange's order: the live monitor's exchange (exchange.py) is only the transport -- it
reads the rows due, passes them and their alarm in, and sends this rank's next row from the
``StepInput.send`` callback, before the verdict's tests run. ``step`` is the only entry: the
live monitor, replay and the simulator call nothing else. Every rank runs the same verdict on
the same gathered evidence; only the leader raises alarms and emits.

Guarantees: deterministic for a deterministic source (replay twice: the same events); the
verdict sequence exists once. Cost: the core's per-sample cost; on an alarm, the source's
tests plus one ``localize.decide`` per evidence set (microseconds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from stalwart.detect.alarms import DETECTS, MODES, NONE, QUIET, RECOVER, Alarm, IterSample
from stalwart.detect.decision import DecisionCore
from stalwart.detect.evidence import Finding, RankEvidence
from stalwart.detect.localize import (
    decide,
    more_rounds,
    pairs_to_retest,
    retested,
    slowest_counts,
)

ROUNDS = 3  # the compute test's first rounds (validate.compute_test's default)
VALIDATION_FILE = "validation.jsonl"  # a run directory's raw validation rounds (rank 0)


class EvidenceSource(Protocol):
    """The validation tests' measurements, gathered from every rank (rank order).

    ``tests``: the first compute rounds and the ring's link pairs around an alarm (``own``:
    this rank's training-time profile, ``DecisionCore.evidence``); ``more_rounds``: that many
    more compute rounds on every rank; ``more_links``: the pairs the ring did not test (None:
    there are none, or the source cannot measure them); ``retest_links``: those pairs ("a-b")
measured once more, pair -> time in the unit of the links ({}: the source cannot);
``recovery_ratio``: the compute test
    at equal load, the suspect's median round over its peers' (None: not measured)."""

    def tests(self, alarm: Alarm, decided: int, own: RankEvidence) -> list[RankEvidence]: ...

    def more_rounds(self, rounds: int) -> list[RankEvidence]: ...

    def more_links(self) -> list[RankEvidence] | None: ...

    def retest_links(self, pairs: list[str]) -> dict[str, float]: ...

    def recovery_ratio(self, suspect: int, decided: int) -> float | None: ...


@dataclass
class StepInput:
    """What one rank learns at one step (see the module docstring); ``alarm``: the alarm the
    rows read now carried (None or QUIET: none); ``decided``: the step a verdict is dated
    (default: the sample's key)."""

    sample: IterSample | None = None
    rows: Sequence[tuple[int, list[float]]] = ()
    alarm: Alarm | None = None
    decided: int | None = None
    issue: bool = True  # a row leaves at this step (batched exchanges: every K steps)
    # the transport that sends it now, before the verdict's tests (live: the exchange); None:
    # the caller sends ``StepOutput.send`` itself (replay, the simulator)
    send: Callable[[Alarm], None] | None = None
    # samples before ``sample``, each taken as a step of its own with no rows, no alarm and
    # no row sent would take it (the live monitor's held steps: ``DecisionCore.sample_many``)
    held: Sequence[IterSample] = ()


@dataclass
class Validation:
    """One validated alarm: what it was, the evidence gathered, the verdict."""

    alarm: Alarm
    decided: int
    evidence: list[RankEvidence]
    finding: Finding
    retest: dict[str, float] = field(default_factory=dict)  # lone slow pairs read again

    def record(self) -> dict[str, Any]:
        """The raw rounds as a run directory keeps them (``validation.jsonl``), compact."""
        out = {"kind": "validation", "step": self.decided, "action": self.alarm.action,
               "onset": self.alarm.onset, "severity": _r(self.alarm.severity),
               "suspect": self.alarm.suspect,
               "evidence": [_r(asdict(e)) for e in self.evidence]}
        if self.retest:
            out["retest"] = _r(self.retest)
        return out


@dataclass
class StepOutput:
    send: Alarm  # the alarm to send with the next row (QUIET: none)
    validation: Validation | None = None  # the verdict applied at this step, if any
    recovery: dict[str, Any] | None = None  # the recovery test applied, if any
    paused: bool = False  # the tests ran (a validation pause)
    events: list[Any] = field(default_factory=list)


def _r(x: Any) -> Any:
    """Floats to 6 significant digits (compact records; the decisions do not need more)."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _r(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_r(v) for v in x]
    return x


class Detector:
    """The decision path for one rank (module docstring)."""

    def __init__(self, core: DecisionCore, source: EvidenceSource, rank: int = 0) -> None:
        self.core = core
        self.source = source
        self.rank = rank
        self._events: list[Any] = []
        # per rank: (slowest rounds, rounds) of this job's compute tests since it was last
        # named (localize.decide's ``prior``); reset when the job size changes
        self._pool: dict[int, tuple[int, int]] = {}
        self._pool_n = 0
        core.add_sink(self._record)

    def _record(self, ev: Any) -> None:
        """An event of the step in progress, for its ``StepOutput.events``."""
        self._events.append(ev)

    def step(self, inp: StepInput) -> StepOutput:
        core = self.core
        self._events = []
        if inp.held:  # (the step's own sample after them, in the same batch)
            core.sample_many([*inp.held, inp.sample] if inp.sample is not None else inp.held)
        elif inp.sample is not None:
            core.sample(inp.sample)
        if inp.rows:
            core.relative_rows(inp.rows)
        alarm = inp.alarm
        arrived = alarm is not None and alarm.action != NONE
        if arrived and core.leader:
            core.alarm_read()
        # the next row leaves before the verdict, as over the live exchange (exchange.py)
        out = StepOutput(send=core.take_pending() if inp.issue else QUIET)
        if inp.issue and inp.send is not None:
            inp.send(out.send)
        if arrived:
            assert alarm is not None
            decided = inp.decided if inp.decided is not None else (
                core.samples[-1].key if core.samples else alarm.onset)
            self._resolve(alarm, decided, out)
        out.events = self._events
        return out

    def _resolve(self, alarm: Alarm, decided: int, out: StepOutput) -> None:
        """An alarm that reached every rank: validated and applied (a change, an outlier, the
        audit) or a recovery judged."""
        if alarm.action in DETECTS:
            out.validation = self.validate(alarm, decided)
            out.paused = True
        elif alarm.action == RECOVER:
            out.recovery, out.paused = self.recover(alarm, decided)

    def validate(self, alarm: Alarm, decided: int) -> Validation:
        """The tests on an alarm, the verdict on their gathered evidence, applied."""
        suspect = alarm.suspect if alarm.suspect >= 0 else None
        mode = MODES[alarm.action]
        src = self.source
        ev = src.tests(alarm, decided, self.core.evidence(self.rank, alarm.onset, decided))
        while extra := more_rounds(ev, suspect, mode):
            have = len(ev[0].compute_rounds) if ev else 0
            ev = src.more_rounds(extra)
            if not ev or len(ev[0].compute_rounds) <= have:
                break  # a source that cannot measure more (a recording) decides on what it has
        first = self.core.first_key
        if len(ev) != self._pool_n:
            self._pool, self._pool_n = {}, len(ev)
        prior = self._pool
        finding = decide(ev, alarm.onset, decided, alarm.severity, suspect, mode, first,
                         prior)
        if finding.kind == "unknown":
            # a slow link between ranks that are not ring neighbours
            more = src.more_links()
            if more is not None:
                ev = more
                finding = decide(ev, alarm.onset, decided, alarm.severity, suspect, mode,
                                 first, prior)
        again: dict[str, float] = {}
        pairs = pairs_to_retest(finding, ev)
        if pairs:  # slow pairs read once: read them again before naming their link
            again = src.retest_links(pairs)
            finding = retested(finding, ev, again)
        self._pool_rounds(ev, finding)
        self.core.apply_verdict(finding, suspect, self._pause_s(), alarm.action)
        return Validation(alarm, decided, ev, finding, again)

    def _pool_rounds(self, ev: list[RankEvidence], finding: Finding) -> None:
        """This validation's compute rounds join every rank's pool -- except the ranks of a
        straggler being followed or named now, whose pools restart empty (their slow rounds
        must not confirm them again once healthy)."""
        rounds = min((len(e.compute_rounds) for e in ev), default=0)
        if rounds == 0:
            return
        named = set(finding.ranks) if finding.kind in ("compute", "link") else set()
        active = self.core.active
        if active is not None:
            named |= set(active.ranks)
        slowest = slowest_counts(ev)
        pool = self._pool
        for r, k in slowest.items():
            if r in named:
                pool.pop(r, None)
                continue
            k0, m0 = pool.get(r, (0, 0))
            pool[r] = (k0 + k, m0 + rounds)

    def _pause_s(self) -> float:
        """The seconds the source's tests took (live: wall time; recorded: as recorded)."""
        return float(getattr(self.source, "pause_s", 0.0))

    def recover(self, alarm: Alarm, decided: int) -> tuple[dict[str, Any], bool]:
        """A recovery alarm: a compute straggler's is confirmed by the compute test at equal
        load first (recovery.py)."""
        core = self.core
        ratio = None
        tested = False
        if core.needs_recovery_test() and core.active is not None:
            ratio = self.source.recovery_ratio(core.active.ranks[0], decided)
            tested = ratio is not None
        if core.recovery_test(ratio, decided):
            core.apply_recovery(alarm.onset, decided, alarm.severity, ratio)
        rec = {"kind": "recovery", "step": decided, "ratio": _r(ratio)}
        return rec, tested
