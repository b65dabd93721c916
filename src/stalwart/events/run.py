"""The run's life: the launcher's start, end and restarts; rank 0's devices, resume, evals,
checkpoints, halt and overlap schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stalwart.events.base import Event


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
