"""In-place membership: the rank side of a job that regroups without a restart. A lost rank
(a failed collective), a planned S3/S4 change, or a host taken back makes every member
rebuild its process groups for the launcher's next generation, agree on the model and
optimizer state, and go on at the agreed step.

``InPlace`` is the object a rank of such a job owns (``Rank.inplace``; None in any other
job): it holds the membership watcher (``regrouper``, mitigate/regroup.py) and the in-place
state -- the steps the last agreement settled on, a planned change's hosts, and in a
``--comm lossy`` job the optimizer generations kept for a regroup broken off half-way and
the shards handed over by members a planned change leaves out. Its operations: ``join`` (a
rank started again to take its host back), ``regroup``, ``planned`` (an S3/S4 decision in
such a job), ``fall_back`` and ``leave``. It changes the rank only through the rank's own
methods: ``release`` (the old groups' parts closed), ``place`` (its rank and data shard in
the new world) and ``plug`` (the new step, optimizer, monitor and work plan). In a lossy
job the owners' optimizer state is re-sharded over the new group (``_regroup_lossy``, with a
leaving member's shard handed over first, ``_hand_over``) and a new lossy optimizer made.

Guarantees:
- every member resumes at the same step, the most advanced state any member holds: at most
  the step in flight is redone (lossy: the fewest steps any member applied, a member one
  step ahead undoing its shard's last update; a dead owner's per-element optimizer state
  restarts from zero);
- every member agrees on the evaluation and checkpoint due at that step (``agree_boundary``:
  redone by all unless every member did it), so no member enters the next step's
  collectives while another is in the evaluation's;
- a regroup broken by a further membership change (a member lost during it) is redone on the
  next generation, up to MAX_REGROUPS times in a row (``regroup_until_done``);
- any other failure of a regroup saves the rank's own state without a collective and exits 0
  with a ``fallback`` exit record (elastic/runlink.py): the launcher relaunches from the most
  advanced state (mitigate/fallback.py);
- a rank the new generation leaves out exits 0 with a ``left`` exit record, without the
  job's collectives.

Cost: nothing per step; a regroup takes 0.6-0.9 s on the netns testbed (4 ranks on 2 cores):
new groups on the generation's store, two all-gathers (the state, the boundary's work; the
model and optimizer state move only to the ranks that lack it), a new monitor, DDP wrapper
and work plan.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from stalwart.events import Regroup
from stalwart.train import checkpoint as ckpt
from stalwart.train.steps import DataParallelStep, make_groups

if TYPE_CHECKING:
    from stalwart.mitigate.regroup import Regrouper
    from stalwart.train.rank import Rank

# S3/S4's price while no in-place regroup has been measured yet in this job: 0.6-0.9 s
# measured on the netns testbed (4 ranks on 2 cores), rounded up
REGROUP_PRICE_S = 1.0


MAX_REGROUPS = 8  # membership changes in a row a regroup follows before the rank gives up
JOIN_WAIT_S = 120.0  # a rank started to rejoin gives up (and leaves) after this long


@runtime_checkable
class InterruptibleOptimizer(Protocol):
    """An optimizer whose step waits for its peers' packets (``stalwart.comm``'s loss-tolerant
    one): a lost member's word makes it give up (``InPlace.interrupt_comm``). Others (AdamW)
    have no wait of their own: DDP's collective fails instead."""

    def interrupt(self, why: str) -> None:
        """From any thread: the step in progress, or the next one, raises at its next wait,
        with ``why``."""
        ...


@runtime_checkable
class ShardedOptimizer(Protocol):
    """An optimizer each rank holds a shard of (``stalwart.comm``'s loss-tolerant one): a
    member a planned change leaves out hands its shard over before it goes
    (``InPlace._hand_over``). Others (AdamW) are whole on every rank."""

    def piece(self) -> dict[str, Any]:
        """This rank's shard as a self-contained piece of the whole optimizer (a copy: the
        optimizer may go on)."""
        ...


def first_line(err: BaseException) -> str:
    """An error's first line (its type's name when it has none), at most 240 characters."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:240]


class InPlace:
    """One rank's in-place membership (see the module's docstring), owned by its ``Rank``."""

    def __init__(self, rank: Rank, regrouper: Regrouper, rejoiner: bool = False) -> None:
        """``rejoiner``: the process was started again to take its host back (``join``)."""
        self.r = rank
        self.regrouper = regrouper
        self.rejoiner = rejoiner
        self.agreed = -1  # the steps applied that the last regroup's state agreement settled on
        self.planned_change: list[int] | None = None  # a planned change's hosts, due now
        self.opt_gen = 0  # the membership generation the (lossy) optimizer was made for
        # lossy, after a regroup: (generation, the optimizer exported from) until the new one
        # has completed a step (a regroup broken off half-way exports it again)
        self.lossy_prev: tuple[int, Any] | None = None
        # lossy: (generation, shard) handed over by ranks a planned change leaves out
        self.lossy_extra: list[tuple[int, Any]] = []
        # pairs of hosts whose link was found slow and not found recovered: the next
        # generations' detectors leave them out of their link tests (``_slow_links``)
        self.slow_hosts: set[tuple[int, int]] = set()
        regrouper.on_abort.append(self.interrupt_comm)

    def _note_slow_links(self, monitor: Any, cfg: Any) -> None:
        """The host pairs of the closed ``monitor``'s link findings still in force join
        ``slow_hosts`` (read after its close: no wait on a collective a lost member broke)."""
        from stalwart.mitigate import remap

        links: list[tuple[int, int]] = []
        with contextlib.suppress(Exception):  # a monitor whose last analysis failed: none
            links = [(f.link[0], f.link[1]) for f in (monitor.findings if monitor else [])
                     if f.kind == "link" and f.link and f.recovered_step is None]
        slots = list(cfg.job.hosts) if cfg.job.hosts else list(range(cfg.job.nproc))
        self.slow_hosts |= remap.host_pairs(links, slots, cfg.testbed.ranks_per_host)

    def _slow_links(self, cfg: Any) -> set[tuple[int, int]]:
        """Collective on the new group: the rank pairs on a slow pair of hosts
        (``slow_hosts``, united over the ranks: a joiner knows none), which the new
        monitor's link tests leave out -- an S3 placement took the job's traffic off them,
        and a test would send it there again and find the same link a second time."""
        from stalwart.mitigate import remap

        known: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(known, sorted(self.slow_hosts))
        self.slow_hosts = {(int(a), int(b)) for got in known for a, b in (got or [])}
        return remap.rank_pairs_on(self.slow_hosts, list(cfg.job.hosts),
                                   cfg.testbed.ranks_per_host)

    def regroups_after(self, err: BaseException) -> bool:
        """Whether ``err``, raised by a step, is one a regroup handles: a failed collective or
        a membership change already announced."""
        from stalwart.mitigate.regroup import is_comm_error

        return self.regrouper.changed() or is_comm_error(err)

    def interrupt_comm(self) -> None:
        """The membership watcher's word that a member is lost (its thread): a lossy
        optimizer's collective stops waiting for the dead owner's packets, so the step in
        progress fails now, before its update (or with it undone) -- not a deadline cap later,
        having trained on without the dead rank's share of the batch; a tensor-parallel step's
        collectives stop waiting on pairs a peer may have shut first (overlap/comm.py)."""
        why = "the job's membership changed (a member was lost)"
        opt = self.r.opt
        if isinstance(opt, InterruptibleOptimizer):  # the lossy transport
            opt.interrupt(why)
        self.r.stepper.interrupt(why)  # tensor-parallel steps' waits (others: nothing)

    def stepped(self) -> None:
        """A step completed on the current optimizer: every rank has made it, so the one
        kept for a regroup broken off half-way is not needed."""
        self.lossy_prev = None

    def join(self) -> int:
        """Say this rank is ready, wait for the generation that takes it back, and regroup
        into it: the parameters and optimizer state come from a peer (``agree_state``).
        Returns the step to run next; raises TimeoutError when no generation takes it."""
        self.regrouper.link.ready(self.regrouper.slot)  # the launcher then asks rank 0
        return self.regroup(0, "rejoined", timeout_s=JOIN_WAIT_S)

    def regroup(self, applied: int, why: str, timeout_s: float | None = None) -> int:
        """Rebuild the rank's distributed state for the next generation, in place: process
        groups, the model's state agreed, DDP, monitor, work plan (the same global batch over
        the ranks now in the job). Returns the step to run next, agreed by every rank.
        Raises NotAMember when the new generation leaves this rank out."""
        from stalwart.mitigate import membership, work_plan
        from stalwart.mitigate.regroup import agree_boundary, agree_shards, agree_state

        r = self.r
        t0 = time.monotonic()
        joiner = self.regrouper.joining  # has done nothing yet: the others decide
        cfg = r.cfg
        monitor = r.monitor
        r.release()
        self._note_slow_links(monitor, cfg)
        before = self.regrouper.current
        lossy = cfg.comm.mode == "lossy"
        if lossy:
            self._hand_over()
        try:
            g = self.regrouper.regroup(r.devices.backend, **(
                {"timeout_s": timeout_s} if timeout_s is not None else {}))
        except TimeoutError as t:  # not a lost peer: the original failure is the news
            raise RuntimeError(f"{why} ({t})") from None
        parts = {"groups": time.monotonic() - t0}
        rank, world = dist.get_rank(), dist.get_world_size()
        # the new membership: a new configuration value (the job section), the rank's own
        r.cfg = cfg = replace(cfg, job=replace(cfg.job, nproc=world, hosts=tuple(g.hosts)))
        model, reset = r.stepper.model, 0
        if cfg.train.tp > 1:  # new TP and DP groups; the shards follow the new TP indices
            tp_group, dp_group, data_rank, data_parts = make_groups(world, cfg.train.tp)
            r.place(rank, world, data_rank, data_parts)
            r.stepper.rebind(tp_group, dp_group)
            done, src = agree_shards(model, r.opt, applied, r.tp_index, cfg.train.tp)
            r.place(rank, world, data_rank, data_parts, tp_index=rank % cfg.train.tp)
        elif lossy:  # the owners' state re-sharded; a new optimizer (and DDP) for the world
            r.place(rank, world, rank, world)
            done, src, reset = self._regroup_lossy(applied, g.gen)
        else:
            r.place(rank, world, rank, world)
            done, src = agree_state(model, r.opt, applied)
        self.agreed = done
        # the evaluation and checkpoint at the agreed step: a collective the lost member broke
        # can have completed on some ranks only -- each rank deciding from its own record
        # would put one in the evaluation's all-reduce, another in the next step's
        r.done_at = agree_boundary(done, r.done_at, joiner)
        parts["state"] = time.monotonic() - t0
        # a monitor made mid-run that sampled its first step from the ops validated a
        # finding inside it: a link test over the slow pair, 1.6-3 s in the first TP step
        r.plug(monitor=r.make_monitor(hinted=True, skip_links=self._slow_links(cfg)))
        parts["monitor"] = time.monotonic() - t0
        if cfg.train.tp == 1 and not lossy:  # (lossy: made with its optimizer, _regroup_lossy)
            r.plug(stepper=DataParallelStep(model, r.device))
        parts["ddp"] = time.monotonic() - t0
        regroup_s = time.monotonic() - t0
        work = work_plan(cfg, r.monitor, rank, world, r.run_dir, r.n_params,
                         max(regroup_s, 0.1), self.regrouper.link)
        if g.planned:
            work.measure_from(g.basis, done + 2)  # its first steps warm up
        r.plug(work=work)
        if rank == 0:
            r.events.emit(Regroup(
                step=done, generation=g.gen, world=world, members=list(g.alive),
                hosts=list(g.hosts), lost=list(g.lost), joined=membership.joined(before, g),
                state_from=src, regroup_s=round(regroup_s, 3), planned=g.planned,
                state_reset=reset if lossy else None,
                parts={k: round(v, 3) for k, v in parts.items()},
                group_parts=self.regrouper.last_parts,
                since_announce_s=round(time.time() - g.time, 3), error=why))
        return done

    def _hand_over(self) -> None:
        """A lossy job's planned change (S4): every member of the old generation is alive and
        between two steps, so before the old groups go each member the new generation leaves
        out sends its shard of the optimizer (``piece``) to the lowest rank that stays, over
        its own link only; the new group then gathers everything (``_regroup_lossy``).
        Nothing moves when nobody leaves (a host taken back)."""
        hosts, self.planned_change = self.planned_change, None
        opt = self.r.opt
        if hosts is None or not isinstance(opt, ShardedOptimizer):
            return
        g = self.regrouper.current  # the old generation: rank r on host g.hosts[r]
        leaving = [r for r, h in enumerate(g.hosts) if h not in hosts]
        staying = [r for r, h in enumerate(g.hosts) if h in hosts]
        if not leaving or not staying:
            return
        if self.r.rank in leaving:
            dist.send_object_list([(self.opt_gen, opt.piece())], dst=staying[0])
        elif self.r.rank == staying[0]:
            for r in leaving:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=r)
                self.lossy_extra.append(box[0])

    def _regroup_lossy(self, applied: int, gen: int) -> tuple[int, int, int]:
        """The lossy optimizer for the new world (generation ``gen``; the rank already placed
        in it): agree on the step, gather the whole optimizer over the new group
        (``gather_full_state``: every member's shard and the pieces handed over by members
        that left, ``_hand_over``; a rank that joins gets it the same way), close the old
        optimizer's transport, plug DDP and a new lossy optimizer (``Rank.make_optimizer``)
        into the rank and load its shard. Returns (the step to run next, the rank whose
        replica filled unowned elements, elements whose per-element state restarted from
        zero).

        The step: the fewest any shard holder applied (``agree_lossy_step``) -- after a
        planned change every member's; after a lost member, a survivor one step ahead (it
        finished a step its peers did not) undoes its last update. A dead owner's elements
        (nobody handed them over) take their parameter values from the lowest such rank's
        replica and restart their per-element state from zero (their scalar state, AdamW's
        step, is the survivors'). Every shard comes from optimizers of one generation: a
        regroup broken off after some ranks had made their new optimizer exports the one
        before, which every rank keeps until the new one completes a step. RuntimeError
        (then: fallback.py) when none of that is possible."""
        from stalwart.comm.optim import ShardedLossyOptimizer, gather_full_state

        r = self.r
        opt, world = r.opt, dist.get_world_size()
        cands = {}  # generation -> this rank's optimizer of that generation
        if isinstance(opt, ShardedLossyOptimizer):
            cands[self.opt_gen] = opt
        if self.lossy_prev is not None:
            cands.setdefault(*self.lossy_prev)
        cur = max(cands, default=-1)
        mine = [applied, cur, int(cur in cands and cands[cur].can_undo()), min(cands, default=-1)]
        got = [torch.zeros(len(mine), dtype=torch.int64) for _ in range(world)]
        dist.all_gather(got, torch.tensor(mine, dtype=torch.int64))
        rows = [[int(x) for x in t] for t in got]
        # the oldest generation any rank still has as its newest optimizer
        export = min((r[1] for r in rows if r[1] >= 0), default=-1)
        old = cands.get(export)
        done, src = agree_lossy_step([[r[0], int(export in (r[1], r[3])),
                                       r[2] if r[1] == export else 0] for r in rows])
        if old is not None and applied == done + 1:
            old.undo_last()  # its peers did not finish that step: nor does its shard
        full = gather_full_state(old, src, extra=[p for g, p in self.lossy_extra if g == export])
        self.lossy_extra = []
        if old is not None:
            self.lossy_prev = (export, old)
        with contextlib.suppress(Exception):  # its transport (the old world's peers)
            if isinstance(opt, ShardedLossyOptimizer):
                opt.close()
        stepper = DataParallelStep(r.stepper.model, r.device)
        r.plug(stepper=stepper)
        r.plug(opt=r.make_optimizer(stepper))
        self.opt_gen = gen
        r.opt.load_full_state(full)
        return done, src, full.reset

    def planned(self, due: Any, step: int) -> bool:
        """An S3/S4 decision (``due``) that starts at ``step``: True when it takes a restart;
        else it is announced here (rank 0) and PlannedRegroup raised on every rank, so that
        the loop regroups."""
        work = self.r.work
        hosts = work.planned_hosts(due)
        if hosts is None:
            return True
        from stalwart.mitigate.decisions import KIND_NAMES
        from stalwart.mitigate.regroup import PlannedRegroup

        if self.r.rank == 0:
            self.regrouper.plan(hosts, step, work.basis(due))
        self.planned_change = hosts  # every member is here, between two steps
        raise PlannedRegroup(f"planned: {KIND_NAMES.get(due.kind, due.kind)} at step {step}, "
                             f"hosts {hosts}")

    def fall_back(self, applied: int, err: BaseException) -> int:
        """The in-place regroup failed (or the launcher gave it up): save this rank's state
        without any collective, say so (a ``fallback`` exit record, elastic/runlink.py) and
        exit 0; the launcher relaunches the job from the most advanced rank's state
        (mitigate/fallback.py)."""
        from stalwart.elastic.runlink import FALLBACK, ExitRecord
        from stalwart.mitigate import fallback
        from stalwart.mitigate.regroup import FallbackRequested

        r = self.r
        reason = first_line(err)
        print(f"stalwart: rank {r.rank} (launch rank {self.regrouper.slot}): in-place "
              f"regroup failed ({reason}); saving state for a relaunch", file=sys.stderr)
        token, slot = self.regrouper.current.token, self.regrouper.slot
        step = max(applied, self.agreed)
        ckpt.save_state(fallback.state_path(r.run_dir, token, slot), step, r.cfg,
                        r.stepper.model, r.opt)
        saved = fallback.Saved(slot, step, r.tp_index, reason,
                               isinstance(err, FallbackRequested), time.time(),
                               r.cfg.comm.mode == "lossy")
        self._exit(ExitRecord(slot, FALLBACK, step, reason, saved=saved))
        return 0

    def leave(self) -> int:
        """Left out by a planned regroup (S4), or not taken back: exit (0, with a ``left``
        exit record) without the job's collectives."""
        from stalwart.elastic.runlink import LEFT, ExitRecord

        self._exit(ExitRecord(self.regrouper.slot, LEFT, max(self.agreed, 0)))
        return 0

    def leave_for_restart(self, step: int) -> int:
        """An S3/S4 decision that takes a restart, at ``step`` (checkpointed by the caller):
        the ``restart`` exit record -- rank 0's carries the next incarnation's host map (the
        plan's ``restart_request``) -- and 0, the code to exit with once the rank is
        finished (``Rank.finish``); the launcher relaunches from the checkpoint."""
        from stalwart.elastic.runlink import RESTART, ExitRecord

        req = self.r.work.restart_request or {}
        self.regrouper.link.exiting(ExitRecord(
            self.regrouper.slot, RESTART, step, str(req.get("reason", "")),
            tuple(int(h) for h in req.get("hosts") or ()), str(req.get("strategy", "")),
            req.get("predicted_gain"), req.get("step_time_before")))
        return 0

    def _exit(self, rec: Any) -> None:
        """Write this rank's exit record (before it exits: the launcher reads it when it sees
        the exit), then close what the rank holds."""
        self.regrouper.link.exiting(rec)
        self.close()
        self.r.metrics.close()
        self.r.events.close()

    def close(self) -> None:
        self.regrouper.close()


def agree_lossy_step(rows: list[list[int]]) -> tuple[int, int]:
    """A lossy job's regroup: the step the members resume at and the rank whose replica
    gives a dead owner's parameter values. ``rows``: per rank (steps applied, holds a shard
    of the generation exported, can undo its last update). The fewest steps any shard holder
    applied: one step more is undone (a survivor that finished a step the others did not),
    more cannot be; RuntimeError then, or when nobody holds a shard."""
    owners = [i for i, r in enumerate(rows) if r[1]]
    if not owners:
        raise RuntimeError("no rank holds a shard of the lossy optimizer")
    done = min(rows[i][0] for i in owners)
    for i in owners:
        ahead = rows[i][0] - done
        if ahead > 1 or (ahead == 1 and not rows[i][2]):
            raise RuntimeError(f"rank {i} applied {rows[i][0]} steps, its peers {done}, and "
                               f"cannot undo them")
    return done, min(i for i in owners if rows[i][0] == done)


def regroup_until_done(r: InPlace, applied: int, why: str) -> int:
    """``r.regroup``, again while it fails because the membership changed meanwhile (a rank
    lost during a regroup -- one started to rejoin that died before joining): the next
    generation is the one to join. Any other failure (and the launcher's fallback) reaches
    ``train``, which saves the rank's state for a relaunch (``Rank.fall_back``)."""
    from stalwart.mitigate.regroup import FallbackRequested, NotAMember, is_comm_error

    for _ in range(MAX_REGROUPS):
        try:
            return r.regroup(applied, why)
        except (NotAMember, FallbackRequested):
            raise
        except Exception as e:  # noqa: BLE001 -- only a membership change is retried
            # a member that dies mid-regroup breaks this one's connections before the
            # launcher's word of it arrives: wait for that word, briefly
            if not (is_comm_error(e) and r.regrouper.await_change()):
                raise
            why = f"regroup interrupted: {(str(e).strip().splitlines() or ['?'])[0][:200]}"
    raise RuntimeError(f"{why} (membership changed {MAX_REGROUPS} times in a row)")
