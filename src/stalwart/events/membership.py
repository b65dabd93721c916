"""Membership and ranks: a rank lost, failed, left, unresponsive or back; an in-place regroup
made or failed; an excluded host probed; the store lost; the torchft peer's quorum."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from stalwart.events.base import Event


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


@dataclass(kw_only=True)
class TorchftQuorum(Event):
    """The torchft peer's quorum changed size (bench/peers/torchft_worker.py)."""

    name: ClassVar[str] = "torchft_quorum"
    step: int
    world: int  # replica groups in the quorum
    quorum_id: int | None
    committed: bool  # the step's update was committed
