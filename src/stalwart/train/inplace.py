"""In-place membership: the rank side of a job that regroups without a restart
(stalwart.mitigate.regroup's ``Regrouper`` is the object plugged into the rank as
``rank.regrouper``). A lost rank (a failed collective), a planned S3/S4 change, or a host
taken back makes every member rebuild its process groups for the launcher's next generation,
agree on the model and optimizer state, and go on at the agreed step.

``InPlaceMembership`` is the part of ``Rank`` (train/rank.py) that does it: ``join`` (a rank
started again to take its host back), ``regroup``, ``restart_due`` (an S3/S4 decision: a
restart, or in such a job a planned regroup), ``fall_back`` and ``leave``. It reads and
rebinds the rank's cfg, rank, world, run_dir, device, devices, events, metrics, stepper, opt,
monitor, work, regrouper, data_rank, data_parts, tp_index, agreed, n_params and done_at.

Guarantees:
- every member resumes at the same step, the most advanced state any member holds: at most
  the step in flight is redone;
- a regroup broken by a further membership change (a member lost during it) is redone on the
  next generation, up to MAX_REGROUPS times in a row (``regroup_until_done``);
- any other failure of a regroup saves the rank's own state without a collective and exits
  with FALLBACK_EXIT: the launcher relaunches from the most advanced state (mitigate/fallback.py);
- a rank the new generation leaves out exits with LEFT_EXIT without the job's collectives.

Cost: nothing per step; a regroup takes 0.6-0.9 s on the netns testbed (4 ranks on 2 cores):
new groups on the generation's store, one all-gather to agree on the state (the model and
optimizer state move only to the ranks that lack it), a new monitor, DDP wrapper and work plan.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch.distributed as dist

from stalwart.train import checkpoint as ckpt
from stalwart.train.steps import DataParallelStep, make_groups

# S3/S4's price while no in-place regroup has been measured yet in this job: 0.6-0.9 s
# measured on the netns testbed (4 ranks on 2 cores), rounded up
REGROUP_PRICE_S = 1.0


MAX_REGROUPS = 8  # membership changes in a row a regroup follows before the rank gives up
JOIN_WAIT_S = 120.0  # a rank started to rejoin gives up (and leaves) after this long


def first_line(err: BaseException) -> str:
    """An error's first line (its type's name when it has none), at most 240 characters."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:240]


class InPlaceMembership:
    """``Rank``'s in-place membership methods (see the module's docstring)."""

    def regroups_after(self, err: BaseException) -> bool:
        """Whether ``err``, raised by a step, is one a regroup handles: a job that regroups
        in place, and a failed collective or a membership change already announced."""
        from stalwart.mitigate.regroup import is_comm_error

        return self.regrouper is not None and (self.regrouper.changed() or is_comm_error(err))

    def join(self) -> int:
        """Say this rank is ready, wait for the generation that takes it back, and regroup
        into it: the parameters and optimizer state come from a peer (``agree_state``).
        Returns the step to run next; raises TimeoutError when no generation takes it."""
        from stalwart.mitigate import membership

        g = self.regrouper.current
        ready = membership.ready_path(self.run_dir, g.token, self.rank)
        from stalwart.rundir import atomic_write_text

        atomic_write_text(ready, json.dumps({"pid": os.getpid(), "time": time.time()}) + "\n")
        done = self.regroup(0, "rejoined", timeout_s=JOIN_WAIT_S)
        self.done_at.update({("eval", done), ("ckpt", done)})  # the others did them
        return done

    def regroup(self, applied: int, why: str, timeout_s: float | None = None) -> int:
        """Rebuild this rank's distributed state for the next generation, in place: process
        groups, the model's state agreed, DDP, monitor, work plan (the same global batch over
        the ranks now in the job). Returns the step to run next, agreed by every rank.
        Raises NotAMember when the new generation leaves this rank out."""
        from stalwart.mitigate import membership, work_plan
        from stalwart.mitigate.regroup import agree_shards, agree_state

        t0 = time.monotonic()
        cfg, model = self.cfg, self.stepper.model
        self.opt.zero_grad(set_to_none=True)  # the failed step's partial gradients
        self.stepper.close()
        for part in (self.monitor, self.work):  # their exchanges failed with the old groups
            with contextlib.suppress(Exception):
                if part is not None:
                    part.close()
        self.monitor = self.work = None
        before = self.regrouper.current
        try:
            g = self.regrouper.regroup(self.devices.backend, **(
                {"timeout_s": timeout_s} if timeout_s is not None else {}))
        except TimeoutError as t:  # not a lost peer: the original failure is the news
            raise RuntimeError(f"{why} ({t})") from None
        parts = {"groups": time.monotonic() - t0}
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cfg.nproc, cfg.hosts = self.world, list(g.hosts)
        if cfg.tp > 1:  # new TP and DP groups; the shards follow the new TP indices
            tp_group, dp_group, self.data_rank, self.data_parts = make_groups(self.world,
                                                                              cfg.tp)
            self.stepper.rebind(tp_group, dp_group)
            done, src = agree_shards(model, self.opt, applied, self.tp_index, cfg.tp)
            self.tp_index = self.rank % cfg.tp
        else:
            self.data_rank, self.data_parts = self.rank, self.world
            done, src = agree_state(model, self.opt, applied)
        self.agreed = done
        parts["state"] = time.monotonic() - t0
        # a monitor made mid-run that sampled its first step from the ops validated a
        # finding inside it: a link test over the slow pair, 1.6-3 s in the first TP step
        self.monitor = self._make_monitor(hinted=True)
        parts["monitor"] = time.monotonic() - t0
        if cfg.tp == 1:
            self.stepper = DataParallelStep(model, self.device)
        parts["ddp"] = time.monotonic() - t0
        regroup_s = time.monotonic() - t0
        self.work = work_plan(cfg, self.monitor, self.rank, self.world, self.run_dir,
                              self.n_params, max(regroup_s, 0.1))
        if g.planned and hasattr(self.work, "measure_from"):
            self.work.measure_from(g.basis, done + 2)  # its first steps warm up
        if self.rank == 0:
            self.events.log("regroup", step=done, generation=g.gen, world=self.world,
                            members=list(g.alive), hosts=list(g.hosts), lost=list(g.lost),
                            joined=membership.joined(before, g),
                            state_from=src, regroup_s=round(regroup_s, 3), planned=g.planned,
                            # cumulative seconds at the end of each part
                            parts={k: round(v, 3) for k, v in parts.items()},
                            group_parts=self.regrouper.last_parts,
                            since_announce_s=round(time.time() - g.time, 3), error=why)
        return done

    def restart_due(self, step: int) -> bool:
        """Whether an S3/S4 decision starts at ``step`` and takes a restart. In a job that
        regroups in place it is announced here instead (rank 0) and PlannedRegroup raised on
        every rank, so that the loop regroups."""
        due = self.work.restart_due(step)
        if due is None:
            return False
        hosts = self.work.planned_hosts(due) if self.regrouper is not None else None
        if hosts is None:
            return True
        from stalwart.mitigate.decisions import KIND_NAMES
        from stalwart.mitigate.regroup import PlannedRegroup

        if self.rank == 0:
            self.regrouper.plan(hosts, step, self.work.basis(due))
        raise PlannedRegroup(f"planned: {KIND_NAMES.get(due.kind, due.kind)} at step {step}, "
                             f"hosts {hosts}")

    def fall_back(self, applied: int, err: BaseException) -> int:
        """The in-place regroup failed (or the launcher gave it up): save this rank's state
        without any collective and exit with FALLBACK_EXIT; the launcher relaunches the job
        from the most advanced rank's state (mitigate/fallback.py)."""
        from stalwart.mitigate import fallback
        from stalwart.mitigate.regroup import FallbackRequested

        reason = first_line(err)
        print(f"stalwart: rank {self.rank} (launch rank {self.regrouper.slot}): in-place "
              f"regroup failed ({reason}); saving state for a relaunch", file=sys.stderr)
        token, slot = self.regrouper.current.token, self.regrouper.slot
        step = max(applied, self.agreed)
        ckpt.save_state(fallback.state_path(self.run_dir, token, slot), step, self.cfg,
                        self.stepper.model, self.opt)
        fallback.record(self.run_dir, token, fallback.Saved(
            slot, step, self.tp_index, reason, isinstance(err, FallbackRequested), time.time()))
        self.regrouper.close()
        self.metrics.close()
        self.events.close()
        return fallback.FALLBACK_EXIT

    def leave(self) -> int:
        """Left out by a planned regroup (S4): exit without the job's collectives."""
        from stalwart.mitigate import LEFT_EXIT

        self.regrouper.close()
        self.metrics.close()
        self.events.close()
        return LEFT_EXIT


def regroup_until_done(r: InPlaceMembership, applied: int, why: str) -> int:
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
