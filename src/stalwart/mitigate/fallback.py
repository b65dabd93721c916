"""When an in-place regroup fails: checkpoint-and-relaunch, the way S3/S4 worked before it.

Mechanism:
1. A rank whose regroup fails (it cannot build the new groups, the new membership does not
   come in time, the membership changed ``MAX_REGROUPS`` times in a row, the re-wrap raised)
   saves its own model, optimizer and RNG state -- no collective: its groups are broken --
   to ``run_dir/fallback/<token>/slot-S.pt``, then writes its exit record (``fallback``,
   elastic/runlink.py ``ExitRecord``) with a ``Saved`` (the optimizer steps it has applied,
   its tensor-parallel index, the reason) and exits 0.
2. The launcher, reading that record when it sees the exit, announces a *fallback*
   generation (membership.py): the
   same members as the generation being built, marked ``fallback``. Every other rank's
   membership thread shuts its connections as for a lost rank, its regroup (or the
   collective it waits in) fails, it sees the mark and saves and exits the same way.
3. Once every rank has exited (or ``WAIT_S`` passed: the rest are stopped), the launcher
   picks the state of the most advanced rank (data-parallel replicas hold the same model and
   optimizer; one file per tensor-parallel index) and makes it an ordinary checkpoint
   (``materialise``: ``checkpoints/step-N/rank-I.pt`` for TP index I, ``WORLD`` = tp, so a
   world of any size reads rank ``r % tp``'s file), and relaunches the job on the fallback
   generation's hosts from it: the same global batch, at most the step in flight redone.
   ``regroup_failed`` (stalwart.events) says why and what was done.

A ``--comm lossy`` job cannot be relaunched this way: each rank holds only its own shard of
the optimizer state (its owner's), which a relaunch at another world size cannot load
(train/checkpoint.py), and the ranks' groups are broken, so nothing can be re-sharded. Its
ranks still save their state (``sharded`` in the sidecar); ``plan`` then finds no usable
state and the job stops with ``regroup_failed`` (fallback "none") and the reason, which says
so -- the simpler of the two correct choices (the other: re-shard the saved files at load).

Guarantees: nothing is lost that the ranks had applied (the most advanced state wins); a
rank that cannot save (killed meanwhile) is simply not a source (its record, written after
its state file, is what makes a state count). At most
``MAX_FALLBACKS`` relaunches per launch, so a failure that repeats does not loop. Cost: a
restart (the ranks' cold start, 10-30 s here) instead of an in-place regroup.

Torch-free: the launcher imports it (files are copied as bytes).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stalwart.rundir import CHECKPOINTS, atomic_write_text

FALLBACK_DIR = "fallback"
WAIT_S = 20.0  # how long the launcher waits for the other ranks to save theirs
MAX_FALLBACKS = 2  # relaunches after a failed regroup, per launch
# a test hook: the launch rank named here refuses to build the groups of any generation
# after the first (as if its process groups could not be made): real processes, one env var
TEST_FAIL_ENV = "STALWART_TEST_REGROUP_FAIL"


@dataclass(frozen=True)
class Saved:
    """One rank's state saved on a failed regroup (part of its ``fallback`` exit record)."""

    slot: int
    step: int  # optimizer steps applied: the step to resume at
    tp_index: int
    reason: str
    requested: bool  # it fell back because another rank had (not on its own failure)
    time: float
    sharded: bool = False  # its optimizer state is its own shard only (--comm lossy)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Saved:
        return Saved(int(d["slot"]), int(d["step"]), int(d["tp_index"]),
                     str(d.get("reason", "")), bool(d.get("requested")),
                     float(d.get("time", 0.0)), bool(d.get("sharded")))


def folder(run_dir: Path, token: str) -> Path:
    return Path(run_dir) / FALLBACK_DIR / token


def state_path(run_dir: Path, token: str, slot: int) -> Path:
    return folder(run_dir, token) / f"slot-{slot}.pt"


def first_reason(states: list[Saved]) -> tuple[str, list[int]]:
    """Why the regroup failed (the earliest rank that failed on its own) and which launch
    ranks failed on their own."""
    own = sorted((s for s in states if not s.requested), key=lambda s: s.time)
    why = own[0].reason if own else "every rank was asked to fall back"
    if any(s.sharded for s in states):
        why += (" (--comm lossy: each rank saved only its shard of the optimizer state, "
                "which a relaunch at another world size cannot load)")
    return why, [s.slot for s in own]


def choose(states: list[Saved], tp: int) -> dict[int, Saved] | None:
    """The state to resume from: for each tensor-parallel index, a rank with the most steps
    applied among those that have every index at that step; None when there is none, or
    when the states are sharded (a lossy job's: see the module's docstring)."""
    if any(s.sharded for s in states):
        return None
    for step in sorted({s.step for s in states}, reverse=True):
        at = {s.tp_index: s for s in sorted(states, key=lambda s: s.slot) if s.step == step}
        if all(i in at for i in range(tp)):
            return {i: at[i] for i in range(tp)}
    return None


def materialise(run_dir: Path, token: str, chosen: dict[int, Saved]) -> int:
    """Make the chosen states the latest checkpoint; returns its step. An existing complete
    checkpoint at that step (one was due there) is used as it is."""
    run_dir = Path(run_dir)
    step = next(iter(chosen.values())).step
    ckpts = run_dir / CHECKPOINTS
    try:
        if int((ckpts / "LATEST").read_text().strip()) == step:
            return step
    except (OSError, ValueError):
        pass
    dst = ckpts / f"step-{step:06d}"
    dst.mkdir(parents=True, exist_ok=True)
    for f in dst.glob("rank-*.pt"):  # an incomplete save of this step: not ours
        f.unlink()
    for i, s in chosen.items():
        tmp = dst / f".rank-{i}.pt.tmp"
        shutil.copyfile(state_path(run_dir, token, s.slot), tmp)
        tmp.replace(dst / f"rank-{i}.pt")
    atomic_write_text(dst / "WORLD", f"{len(chosen)}\n")
    atomic_write_text(ckpts / "LATEST", f"{step}\n")
    return step


def plan(run_dir: Path, token: str, tp: int, states: list[Saved]) -> dict[str, Any] | None:
    """The launcher's relaunch after a failed regroup, from the ranks' saved ``states``
    (their exit records'): {step, reason, failed} with the checkpoint in place, or None when
    no usable state was saved."""
    chosen = choose(states, tp)
    if chosen is None:
        return None
    reason, failed = first_reason(states)
    return {"step": materialise(run_dir, token, chosen), "reason": reason, "failed": failed}
