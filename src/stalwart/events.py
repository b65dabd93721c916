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


# ---- the run's life (launcher, rank 0) ------------------------------------------------------
@dataclass(kw_only=True)
class RunStarted(Event):
    """A launch began: stalwart's launcher (once per ``stalwart run``; a restart inside it is
    a ``Restart``), or rank 0 under torchrun on a fresh start (no checkpoint yet)."""

    name: ClassVar[str] = "run_started"
    optional: ClassVar[tuple[str, ...]] = ("testbed", "resume", "script", "restart", "store")
    nproc: int  # ranks launched
    testbed: str | None = None  # stalwart's launcher: "local" | "netns"
    launcher: str  # "stalwart" | "torchrun" | "torchrun+elastic"
    resume: bool | None = None  # stalwart's launcher: started from a checkpoint (--resume)
    script: str | None = None  # a user's script as the ranks (--script)
    restart: int | None = None  # torchrun: its restart count (TORCHELASTIC_RESTART_COUNT)
    store: str | None = None  # torchrun+elastic: the membership store's address


@dataclass(kw_only=True)
class RunFinished(Event):
    """The job ended: the launcher's exit status (or an interrupt), or rank 0's own line in a
    job that stalwart's launcher did not start (torchrun)."""

    name: ClassVar[str] = "run_finished"
    optional: ClassVar[tuple[str, ...]] = ("exit_code", "reason")
    ok: bool
    exit_code: int | None = None  # the launcher's (or the elastic loop's) exit status
    reason: str | None = None  # "interrupted" (Ctrl-C)


@dataclass(kw_only=True)
class Devices(Event):
    """Rank 0's device plan, once at a fresh start (devices.py)."""

    name: ClassVar[str] = "devices"
    plan: str  # ``DevicePlan.describe()``, e.g. "4 rank(s) on CPU, gloo"
    device: str  # "cpu" | "cuda"
    backend: str  # the process group's backend


@dataclass(kw_only=True)
class Resumed(Event):
    """Rank 0 loaded the checkpoint at ``step`` (``--resume``, or a restart)."""

    name: ClassVar[str] = "resumed"
    step: int
    world: int  # ranks now
    saved_world: int  # ranks that saved it


@dataclass(kw_only=True)
class Eval(Event):
    """A validation loss, after ``step`` steps (rank 0, or the torchft peer's lowest group)."""

    name: ClassVar[str] = "eval"
    optional: ClassVar[tuple[str, ...]] = ("eval_time", "peer")
    step: int
    val_loss: float
    eval_time: float | None = None  # seconds the evaluation took
    peer: str | None = None  # the peer system that wrote it, e.g. "torchft-ddp"


@dataclass(kw_only=True)
class Checkpoint(Event):
    """Every rank's state after ``step`` steps is on disk and LATEST points at it."""

    name: ClassVar[str] = "checkpoint"
    step: int


@dataclass(kw_only=True)
class Halted(Event):
    """The job stopped on purpose at ``step`` (``--halt-at``), checkpointed, to be resumed."""

    name: ClassVar[str] = "halted"
    step: int


@dataclass(kw_only=True)
class Restart(Event):
    """The launcher starts the next incarnation on ``hosts`` from the checkpoint at ``step``
    (an S3/S4 decision that takes a restart, or a failed regroup's fallback)."""

    name: ClassVar[str] = "restart"
    step: int
    nproc: int
    hosts: list[int]  # rank -> host of the next incarnation
    strategy: str  # "exclude_host" | "restore_host" | "remap" | "fallback"
    reason: str
    predicted_gain: float | None  # written as null when the decision had none
    step_time_before: float | None  # median step seconds before it (null: not known)


# ---- membership (launcher, rank 0) --------------------------------------------------------
@dataclass(kw_only=True)
class RankLost(Event):
    """A rank died and the job goes on without it: in place (a regroup follows) or, with
    ``keep_going``, as it is (rankexits.py)."""

    name: ClassVar[str] = "rank_lost"
    optional: ClassVar[tuple[str, ...]] = ("left",)
    step: int  # the launcher's step count
    rank: int  # launch rank
    host: int  # -1: not a member of the newest generation
    exit_code: int  # negative: killed by that signal
    error: str  # the last error line of its log ("" for a signal)
    world_after: int  # ranks left running
    left: list[int] | None = None  # in place: the rest of its tensor-parallel group, who leave


@dataclass(kw_only=True)
class RankFailed(Event):
    """The rank blamed for a failed job (rankexits.culprit); every rank was stopped."""

    name: ClassVar[str] = "rank_failed"
    rank: int
    exit_code: int
    error: str  # its script's exception, or its log's last error line
    step: int


@dataclass(kw_only=True)
class RankLeft(Event):
    """A rank an in-place regroup left out (S4, or a dead rank's TP group) exited."""

    name: ClassVar[str] = "rank_left"
    step: int
    rank: int
    host: int


@dataclass(kw_only=True)
class RankRejoining(Event):
    """An excluded host probed healthy: its launch rank starts again, to rejoin live."""

    name: ClassVar[str] = "rank_rejoining"
    step: int
    rank: int
    host: int
    reason: str  # why taking it back pays (mitigate/probe.py)


@dataclass(kw_only=True)
class RankReady(Event):
    """The rank started to rejoin is ready; rank 0 is asked to take it in."""

    name: ClassVar[str] = "rank_ready"
    step: int
    rank: int
    host: int
    start_s: float  # seconds from its start to ready


@dataclass(kw_only=True)
class RankRestarted(Event):
    """A script's rank killed by a fault with ``back=`` was started again."""

    name: ClassVar[str] = "rank_restarted"
    step: int
    rank: int
    reason: str


@dataclass(kw_only=True)
class RejoinFailed(Event):
    """A rank started to rejoin died before it was back: the job goes on without its host."""

    name: ClassVar[str] = "rejoin_failed"
    step: int
    rank: int
    host: int
    exit_code: int
    error: str


@dataclass(kw_only=True)
class HostProbed(Event):
    """The probe of an excluded host declined to take it back (mitigate/probe.py)."""

    name: ClassVar[str] = "host_probe"
    step: int
    host: int
    restore: bool  # False: not taken back
    reason: str


@dataclass(kw_only=True)
class StoreLost(Event):
    """The membership store process died: no membership change can be announced; the job
    stops."""

    name: ClassVar[str] = "store_lost"
    step: int
    error: str


@dataclass(kw_only=True)
class Regroup(Event):
    """Rank 0: the members rebuilt their process groups in place, generation ``generation``,
    and resume after ``step`` steps (train/inplace.py)."""

    name: ClassVar[str] = "regroup"
    optional: ClassVar[tuple[str, ...]] = ("state_reset",)
    step: int  # steps done, agreed by the members
    generation: int
    world: int
    members: list[int]  # launch ranks alive
    hosts: list[int]  # their hosts (rank -> host)
    lost: list[int]  # launch ranks lost since the last generation
    joined: list[int]  # launch ranks taken in
    state_from: int  # the rank whose model and optimizer state the others took
    regroup_s: float  # seconds from the failure (or the plan) to the new groups
    planned: bool  # a planned change (S3/S4, a host taken back), not a loss
    # a lossy job: elements whose optimizer state restarted from zero (a dead owner's shard)
    state_reset: int | None = None
    parts: dict[str, float]  # cumulative seconds at the end of each part of the regroup
    group_parts: dict[str, float]  # seconds of the process groups' phases
    since_announce_s: float  # seconds since the generation was announced
    error: str | None  # the failure that caused it (null for a planned change)


# ---- the testbed's ground truth -------------------------------------------------------------
@dataclass(kw_only=True)
class _FaultFields(Event):
    """A fault of ``--fault`` (faultspec.Fault.event_fields), as the testbed applied it."""

    optional: ClassVar[tuple[str, ...]] = (
        "start_s", "end_s", "rank", "hosts", "rate", "back_s", "pid", "achieved_factor",
        "at_close", "elapsed_s")
    step: int  # the launcher's step count when it was switched
    testbed: str  # "local" | "netns"
    mechanism: str  # how it acts, e.g. the cgroup quota or the tc qdisc
    kind: str  # "compute" | "contention" | "link" | "pairlink" | "loss" | "kill" | ...
    target: str  # "rank2" | "host1" | "hosts1-2" | "all"
    magnitude: float  # factor, processes, bits per second, loss probability, or 1.0
    spec: str  # as given
    start: int  # its window in steps (end exclusive, null: to the end of the run)
    end: int | None
    start_s: float | None = None  # its window in seconds, when given so
    end_s: float | None = None
    rank: int | None = None  # a rank's fault; else ``hosts``
    hosts: list[int] | None = None
    rate: str | None = None  # link, pairlink: as given, e.g. "50mbit"
    back_s: float | None = None  # kill: seconds after which the rank is started again


@dataclass(kw_only=True)
class FaultApplied(_FaultFields):
    """The testbed switched a fault on."""

    name: ClassVar[str] = "fault_applied"
    pid: int | None = None  # a kill or hang: the process group signalled
    at_close: bool | None = None  # True: switched at the run's end (never False)
    elapsed_s: float | None = None  # a script run: seconds since the ranks started


@dataclass(kw_only=True)
class FaultRemoved(_FaultFields):
    """The testbed switched a fault off."""

    name: ClassVar[str] = "fault_removed"
    achieved_factor: float | None = None  # a CPU fault: the slowdown it achieved
    at_close: bool | None = None  # True: removed because the run ended (never False)
    elapsed_s: float | None = None


@dataclass(kw_only=True)
class TestbedPlacement(Event):
    """The rank -> host map of an incarnation (testbed.placement)."""

    name: ClassVar[str] = "testbed_placement"
    step: int
    testbed: str
    ranks_per_host: int
    slots: list[int]  # launch rank of each rank
    host_of_rank: list[int]  # emulated host of each rank


@dataclass(kw_only=True)
class TestbedCpuCap(Event):
    """Every rank's CPU share is capped (``--testbed-cpus``), once the ranks are known."""

    name: ClassVar[str] = "testbed_cpu_cap"
    step: int
    testbed: str
    cpus: float  # CPUs each rank may use
    hosts: list[int]  # the slots capped
    mechanism: str  # the cgroup quota written


@dataclass(kw_only=True)
class TestbedTraffic(Event):
    """Measured bytes per step between hosts over ``[from_step, to_step)`` (netns testbed)."""

    name: ClassVar[str] = "testbed_traffic"
    step: int
    from_step: int
    to_step: int
    hosts: list[int]  # rank -> host during the segment
    ranks_per_host: int
    bytes_per_step: dict[str, int]  # "a-b" (hosts) -> bytes per step


# ---- other writers ---------------------------------------------------------------------------
@dataclass(kw_only=True)
class OverlapPlan(Event):
    """Rank 0's overlap schedule, each time it changes (overlap/trainer.py)."""

    name: ClassVar[str] = "overlap_plan"
    source: str  # "given" | "loaded" | "profiled"
    key: str  # the plan's signature key
    steps: str  # one letter per stage: f(orward), b(ackward), P (a forward-backward pair)
    pairs: int
    predicted_time: float
    sequential_time: float


@dataclass(kw_only=True)
class FaultDrawn(Event):
    """``stalwart simulate``: a fault the simulator drew for a job size (simulate/faults.py)."""

    name: ClassVar[str] = "fault_drawn"
    optional: ClassVar[tuple[str, ...]] = ("rank", "host")
    job_ranks: int
    kind: str  # "compute" | "link" | "stop"
    rank: int | None = None  # compute: the rank; else ``host``
    host: int | None = None
    factor: float
    start_s: float
    end_s: float | None  # null: to the horizon


@dataclass(kw_only=True)
class TorchftQuorum(Event):
    """The torchft peer's quorum changed size (bench/peers/torchft_worker.py)."""

    name: ClassVar[str] = "torchft_quorum"
    step: int
    world: int  # replica groups in the quorum
    quorum_id: int | None
    committed: bool  # the step's update was committed


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
