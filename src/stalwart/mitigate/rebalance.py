"""Micro-batch rebalancing in a running job (FALCON's S2), as one object the step loop asks.

The step's global batch is M identical micro-batches (train/data.py: a pure function of seed,
step and global micro-batch index). A plan gives data-parallel group i ``n_i`` of them (the
contiguous block ``planner.assignment``); each rank scales its mean micro-batch loss by
``n_i * G / M`` so that the data-parallel average (DDP divides the sum by G) is the mean
gradient over the whole global batch::

    (1/G) * sum_i (n_i G / M) * mean_{j in block i} grad l_j = (1/M) * sum_j grad l_j

-- exactly what a single process computes on the global batch, whatever the plan. FALCON's
public code computes this weighting but never applies it (a rebalanced update is biased); here
the tests check a rebalanced step's parameters against a single-process step.

Per step the loop calls ``assign(step)`` (which micro-batches, which scale) and
``end_step(step, compute_s, step_s)``. Every ``every`` steps the ranks exchange their time per
micro-batch with rank 0 and receive its decision (agreement.py: one version, one start step,
all ranks switch together); rank 0 runs the policy (policy.py) on the detector's findings and
logs ``mitigation_applied`` / ``mitigation_reverted`` / ``mitigation_measured`` to
events.jsonl. A restart decision (S4 without a host, or S3 on a permuted host map) is returned
by ``restart_due`` at its start step; in a job that regroups in place it is made there
(train/inplace.py ``planned``); otherwise the caller checkpoints and leaves for a restart
(rank 0's ``restart_request``: the host map its exit record gives the launcher).

Use in your own DDP script (see docs/mitigate.md)::

    reb = Rebalancer(monitor, micro_batches=M)
    for step in range(steps):
        a = reb.assign(step)
        for k, g in enumerate(a.indices):          # global micro-batch indices
            x, y = my_micro_batch(step, g)          # the same sample for the same (step, g)
            with ddp.no_sync() if k < len(a.indices) - 1 else nullcontext():
                (loss_fn(ddp(x), y) * a.micro_weight).backward()
        opt.step(); opt.zero_grad()
        reb.end_step(step, compute_s, step_s)
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch.distributed as dist

from stalwart.events import (
    MitigationApplied,
    MitigationMeasured,
    MitigationReverted,
    Restart,
    RunStarted,
)
from stalwart.mitigate import planner
from stalwart.mitigate.agreement import (
    EXCLUDE,
    REBALANCE,
    REMAP,
    RESTORE,
    REVERT,
    Decision,
    PlanChannel,
)
from stalwart.mitigate.policy import Policy

MEASURE_STEPS = 6  # steps after a switch over which its gain is measured
# steps the detector is blind after an in-place regroup (its monitor is made again: warm-up
# and a new baseline, detect/): part of what S3/S4 in place cost, besides the regroup itself
REWARM_STEPS = 20


def excluded(dec: Decision) -> set[int]:
    """The hosts (slots) an S4 decision takes out: its target and, for a host of several
    ranks, the others in its counts' slots (1-based)."""
    return {dec.target} | {c - 1 for c in dec.counts if c > 0}


@dataclass(frozen=True)
class Assignment:
    """This rank's share of a step."""

    indices: range  # global micro-batch indices this rank computes
    micro_weight: float  # multiply each micro-batch's loss by this (G / M)
    loss_scale: float  # ... equivalently, its mean micro-batch loss by this (n_i G / M)
    version: int  # plan version (0 = uniform)


@dataclass(frozen=True)
class WindowRow:
    """One rank's measurements over the steps since the last exchange, which rank 0's policy
    reads: compute seconds per micro-batch (``unit``), the mean step time (``step_s``) and the
    number of steps (``steps``). Wire (``PlanChannel``'s row): ``SIZE`` floats in that order.
    """

    unit: float
    step_s: float
    steps: int

    SIZE: ClassVar[int] = 3

    def pack(self) -> list[float]:
        """The row's ``SIZE`` floats."""
        return [self.unit, self.step_s, float(self.steps)]

    @classmethod
    def unpack(cls, vals: list[float]) -> WindowRow:
        """``pack``'s inverse."""
        return cls(vals[0], vals[1], int(vals[2]))


class Detection(Protocol):
    """What the work plan asks of the straggler detector (``stalwart.detect.Monitor``), on
    rank 0 at each exchange: its findings, and a compute test of the straggler it follows."""

    @property
    def findings(self) -> list[Any]:
        """The detector's findings so far (``localize.Finding``), oldest first."""
        ...

    def request_recovery_test(self, step: int) -> bool:
        """Ask for a compute test of the followed straggler at ``step`` (its result decides
        a revert); False: not taken (none followed, or a decision under way)."""
        ...


class Rebalancer:
    """See the module docstring. Create on every rank, after init_process_group."""

    def __init__(self, monitor: Detection | None = None, micro_batches: int = 0, *,
                 rank: int | None = None, world: int | None = None, tp: int = 1,
                 mode: str = "auto", every: int = 2,
                 run_dir: Path | str | None = None, hosts: list[int] | None = None,
                 restart_s: float | None = None,
                 traffic: dict[tuple[int, int], float] | None = None,
                 policy: dict[str, Any] | None = None, in_place: bool = False,
                 ranks_per_host: int = 1, link: Any = None) -> None:
        """``policy``: the policy's settings (min_gain, replan_gain, revert_windows).
        ``link``: the launch's records (elastic/ranklink.py) in a job that regroups in place:
        where rank 0 reads the launcher's request to take a host back.
        ``in_place``: S3/S4 regroup in place (their price is ``restart_s`` as given).
        ``ranks_per_host``: slots to an emulated host (``--ranks-per-host``): an S4 event
        names the host (slot // it), as the finding and the testbed do, not the slot."""
        ready = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if ready else 0)
        self.world = world if world is not None else (dist.get_world_size() if ready else 1)
        if micro_batches < self.world // tp:
            raise ValueError(f"micro_batches={micro_batches}: need at least one per "
                             f"data-parallel group ({self.world // tp})")
        self.monitor = monitor
        self.tp = tp
        self.groups = self.world // tp
        self.group = self.rank // tp
        self.micro = micro_batches
        self.hosts = hosts or list(range(self.world))
        self.ranks_per_host = max(int(ranks_per_host), 1)
        self.run_dir = Path(run_dir) if run_dir is not None else (
            Path(os.environ["STALWART_RUN_DIR"]) if "STALWART_RUN_DIR" in os.environ else None)
        self.counts = planner.uniform(micro_batches, self.groups)
        self.version = 0
        # room for a rank -> host map (S3 in place) even when TP makes fewer groups than ranks
        self.channel = PlanChannel(self.world, self.groups, row_len=WindowRow.SIZE, every=every,
                                   slots=self.world)
        self.policy = Policy(self.groups, micro_batches, tp=tp, mode=mode, every=every,
                             **(policy or {})) if self.rank == 0 else None
        # S3/S4 regroup in place (``planned_hosts``): their price is ``restart_s`` as given,
        # not this process's start-up
        self.in_place = in_place
        self.link = link
        self._regroup_s = restart_s or 0.0
        if self.policy is not None and restart_s is not None:
            self.policy.restart_s = restart_s
        if self.policy is not None and in_place:
            self.policy.moves_by = "regroup"
        if self.policy is not None:
            self.policy.traffic, self.policy.hosts = traffic, list(self.hosts)
        self._pending: Decision | None = None  # agreed, waiting for its start step
        self._sent: dict[int, Decision] = {}  # rank 0: version -> decision (with reason)
        self._restart: Decision | None = None
        # rank 0: the last S3/S4 decision's host map and basis, for a restart's exit record
        self.restart_request: dict[str, Any] | None = None
        self._win_compute = 0.0
        self._win_micro = 0
        self._win_step = 0.0
        self._win_steps = 0
        self._step_times: list[tuple[int, float]] = []  # rank 0: (step, step time)
        # what to measure: (strategy, version, predicted gain, step time before, start step)
        self._measure: tuple[str, int, float, float, int] | None = None
        self._events: Any = None
        if self.rank == 0 and self.run_dir is not None:
            from stalwart.rundir import EventLog

            self._events = EventLog(self.run_dir)
            self._measure_restart()

    # ---- the loop's two calls -----------------------------------------------------------
    def assign(self, step: int) -> Assignment:
        d = self._pending
        if d is not None and step >= d.start_step:
            self._pending = None
            if d.kind in (REBALANCE, REVERT):
                self.counts, self.version = list(d.counts), d.version
            elif d.kind in (EXCLUDE, RESTORE, REMAP):
                self._restart = d
        block = planner.assignment(self.counts)[self.group]
        n = len(block)
        weight = self.groups / self.micro
        return Assignment(block, weight, n * weight, self.version)

    def restart_due(self, step: int) -> Decision | None:
        """A restart decision whose start step has come (call after ``assign``)."""
        return self._restart

    def planned_hosts(self, dec: Decision) -> list[int] | None:
        """The rank -> host map an S4 exclusion or an S3 re-map asks for, on every rank
        (an in-place regroup needs it everywhere, not in rank 0's restart request), and for a host
        taken back live (its rank started again and waiting to join); None for a restore by a
        restart."""
        if dec.kind == EXCLUDE:
            return [h for h in self.hosts if h not in excluded(dec)]
        if dec.kind == REMAP and len(dec.counts) == len(self.hosts):
            return list(dec.counts)  # rank 0 sent the new map in the counts' slots
        if dec.kind == RESTORE and dec.counts == [h + 1 for h in self.hosts]:
            return sorted([*self.hosts, dec.target])  # live: its rank is waiting to join
        return None

    def basis(self, dec: Decision) -> dict[str, Any]:
        """Rank 0: what a planned regroup's gain is measured against (``measure_from``)."""
        return {"strategy": dec.name, "predicted_gain": dec.predicted_gain,
                "step_time_before": self._recent_step_time()}

    def measure_from(self, basis: dict[str, Any] | None, start: int) -> None:
        """Rank 0 after a planned regroup: measure its gain like a plan switch's (the first
        steps after it warm up: from ``start``)."""
        if self.rank == 0 and basis and basis.get("step_time_before"):
            self._measure = (str(basis["strategy"]), 0, float(basis["predicted_gain"]),
                             float(basis["step_time_before"]), start)

    def normalised(self, compute_s: float) -> float:
        """This step's compute time as if the plan were uniform: what a detector should see
        (a rebalanced straggler computes less per step, but is no faster per micro-batch)."""
        n = self.counts[self.group]
        return compute_s * (self.micro / self.groups) / max(n, 1)

    def end_step(self, step: int, compute_s: float, step_s: float) -> None:
        self._win_compute += compute_s
        self._win_micro += self.counts[self.group]
        self._win_step += step_s
        self._win_steps += 1
        if self.rank == 0:
            if not self._step_times and self.policy is not None and not self.in_place:
                # a restart's price: what this incarnation took to reach its first step
                self.policy.restart_s = _process_age()
            if self.in_place and self.policy is not None and self.policy.healthy_step_s:
                self.policy.restart_s = (self._regroup_s
                                         + REWARM_STEPS * self.policy.healthy_step_s)
            self._step_times.append((step, step_s))
            self._step_times = self._step_times[-64:]
            self._check_measure(step)
        if not self.channel.due(step):
            return
        row = WindowRow(self._win_compute / max(self._win_micro, 1),
                        self._win_step / max(self._win_steps, 1), self._win_steps)
        self._win_compute, self._win_micro, self._win_step, self._win_steps = 0.0, 0, 0.0, 0
        rows, dec = self.channel.receive()
        if dec is not None:
            if dec.start_step <= step:  # cannot happen: the start is after the read
                raise RuntimeError(f"plan v{dec.version} starts at {dec.start_step}, read at "
                                   f"step {step}")
            self._pending = dec
            if self.rank == 0:
                self._log_decision(step, dec)
        out = None
        if self.rank == 0 and rows is not None and self._pending is None:
            out = self._decide(step, [WindowRow.unpack(r) for r in rows])
            if out is not None:
                self._sent[out.version] = out
        self.channel.send(row.pack(), out)

    # ---- rank 0 ------------------------------------------------------------------------------
    def _decide(self, step: int, rows: list[WindowRow]) -> Decision | None:
        """Rank 0: the policy's decision (None: none) from every rank's ``rows`` (rank
        order) of the exchange read at ``step``; the detector asked for a recovery test if
        the policy wants one."""
        assert self.policy is not None
        units = [max(rows[r].unit for r in range(g * self.tp, (g + 1) * self.tp))
                 for g in range(self.groups)]
        step_s = statistics.median(r.step_s for r in rows)
        steps = rows[0].steps
        findings = list(self.monitor.findings) if self.monitor is not None else []
        self.policy.counts = list(self.counts)
        start = self.channel.start_for(step)
        dec = self.policy.observe(step, units, step_s, steps, findings, start)
        if self.policy.wants_recovery_test and self.monitor is not None:
            # the detector's compute test decides the revert
            self.monitor.request_recovery_test(step)
        if dec is None and self.policy.mode == "auto":
            dec = self._control(start)
        if dec is not None and dec.kind == EXCLUDE:
            # the rank's host; the other ranks leaving with it (a host of several ranks:
            # policy.leaving) travel 1-based in the counts' slots (0: none)
            first = self.hosts[dec.target]
            dec.counts = [self.hosts[r] + 1 for r in dec.hosts if self.hosts[r] != first]
            dec.target = first
        if dec is not None and dec.kind == REMAP and self.in_place:
            dec.counts = list(dec.hosts)  # one host per rank: the channel has world slots
        return dec

    def _control(self, start: int) -> Decision | None:
        """The launcher's probe found an excluded host healthy and its rank is ready to join
        (a ``TakeBack`` record; one store round trip per exchange while there is none):
        take it back."""
        req = self.link.take_back() if self.link is not None else None
        if req is None:
            return None
        host = req.host
        if host < 0 or host in self.hosts:
            return None
        assert self.policy is not None
        self.policy.version += 1
        # live: the launcher started the host's rank again and it is ready to join in place.
        # Marked by today's hosts (1-based) in the counts' slots: the new map has one host
        # more than the message has slots, and every rank can build it (planned_hosts)
        live = [h + 1 for h in self.hosts] if req.live and self.in_place else []
        return Decision(RESTORE, self.policy.version, start, live, host, req.predicted_gain,
                        req.reason or "excluded host healthy again")

    def _next_hosts(self, dec: Decision, sent: Decision) -> list[int]:
        """The rank -> host map a restart decision asks for."""
        if dec.kind == EXCLUDE:
            return [h for h in self.hosts if h not in excluded(dec)]
        if dec.kind == REMAP:
            return list(sent.hosts)
        return sorted([*self.hosts, dec.target])

    def _log_decision(self, step: int, dec: Decision) -> None:
        sent = self._sent.pop(dec.version, dec)
        if dec.kind in (EXCLUDE, RESTORE, REMAP):  # taken in place, or by a restart
            self.restart_request = {
                "hosts": self._next_hosts(dec, sent), "step": dec.start_step,
                "strategy": dec.name, "reason": sent.reason,
                "predicted_gain": round(dec.predicted_gain, 4),
                "step_time_before": self._recent_step_time()}
        if self._events is None:
            return
        before = self._recent_step_time()
        if dec.kind == REVERT:
            self._events.emit(MitigationReverted(dec.start_step, step, "rebalance", dec.version,
                                                 dec.counts, sent.reason))
        else:
            target = f"rank{dec.target * self.tp}" if dec.kind == REBALANCE else (
                f"host{dec.target // self.ranks_per_host}" if dec.kind != REMAP else "hosts")
            plan: list[int] = dec.counts if dec.kind == REBALANCE else \
                self._next_hosts(dec, sent)
            self._events.emit(MitigationApplied(dec.start_step, step, dec.name, dec.version,
                                                plan, target, round(dec.predicted_gain, 4),
                                                sent.reason))
        if dec.kind in (REBALANCE, REVERT) and before is not None:
            self._measure = ("rebalance" if dec.kind == REBALANCE else "revert", dec.version,
                             dec.predicted_gain, before, dec.start_step)

    def _recent_step_time(self) -> float | None:
        xs = [t for _, t in self._step_times[-2 * self.channel.every:]]
        return statistics.median(xs) if xs else None

    def _check_measure(self, step: int) -> None:
        if self._measure is None:
            return
        strategy, version, predicted, before, start = self._measure
        after = [t for s, t in self._step_times if s >= start]
        if len(after) < MEASURE_STEPS:
            return
        self._measure = None
        t = statistics.median(after)
        gain = 1.0 - t / before
        if self.policy is not None:
            self.policy.measured(strategy, version, gain)  # a plan that hurts is undone
        if self._events is not None:
            self._events.emit(MitigationMeasured(step, version, strategy, round(predicted, 4),
                                                 round(gain, 4), round(before, 5),
                                                 round(t, 5)))

    def _measure_restart(self) -> None:
        """After a planned restart (S3/S4), measure its gain like a plan switch's: the step
        time rank 0 saw before it left (in the launcher's ``restart`` event) against the
        first steps here."""
        from stalwart.rundir import read_jsonl

        try:
            last = [e for e in read_jsonl(self.run_dir / "events.jsonl")
                    if e.get("event") in (Restart.name, RunStarted.name)][-1:]
        except OSError:
            return
        if last and last[0]["event"] == Restart.name and last[0].get("step_time_before"):
            e = last[0]
            # the first steps after a restart warm up (allocator, gloo buffers): skip 2
            self._measure = (str(e.get("strategy")), 0, float(e.get("predicted_gain", 0.0)),
                             float(e["step_time_before"]), int(e.get("step", 0)) + 2)

    def close(self) -> None:
        self.channel.close()
        if self._events is not None:
            self._events.close()


def _process_age() -> float:
    """Seconds since this process started (interpreter, imports, rendezvous, model, step 1)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 30.0


class StaticPlan:
    """The uniform plan, never changed: what the loop uses without ``--mitigate`` or with one
    data-parallel group (no exchanges, no cost). The same members as ``Rebalancer`` (the
    rank's ``WorkPlan``, train/rank.py); it never decides a change."""

    def __init__(self, micro_batches: int, groups: int, group: int) -> None:
        self.micro, self.groups, self.group = micro_batches, groups, group
        self.restart_request: dict[str, Any] | None = None  # never one: it decides nothing
        block = planner.assignment(planner.uniform(micro_batches, groups))[group]
        w = groups / micro_batches
        self._a = Assignment(block, w, len(block) * w, 0)

    def assign(self, step: int) -> Assignment:
        return self._a

    def restart_due(self, step: int) -> Decision | None:
        return None

    def planned_hosts(self, dec: Decision) -> list[int] | None:
        """Never: RuntimeError (``restart_due`` gives no decision to plan)."""
        raise RuntimeError("the static plan decides no change")

    def basis(self, dec: Decision) -> dict[str, Any]:
        """Never: RuntimeError, as ``planned_hosts``."""
        raise RuntimeError("the static plan decides no change")

    def measure_from(self, basis: dict[str, Any] | None, start: int) -> None:
        """Nothing: a planned regroup into a world this plan serves is not measured (one
        data-parallel group: no policy to tell)."""

    def normalised(self, compute_s: float) -> float:
        return compute_s * (self.micro / self.groups) / max(len(self._a.indices), 1)

    def end_step(self, step: int, compute_s: float, step_s: float) -> None:
        pass

    def close(self) -> None:
        pass
