"""One rank's job as an object: ``Rank.start`` builds it once -- devices, the process group,
the run directory and logs, then each capability plugged in as an object -- and the loop
(train/worker.py) calls its steps: ``enter``, ``set_lr``, ``train_step``, ``record``,
``after`` (evaluation, checkpoint), ``finish``. In a job that regroups in place the rank
owns its membership (``inplace``: train/inplace.py ``InPlace``), which rebuilds the rank's
parts through ``release``, ``place`` and ``plug``.

The capabilities and their seams: the step (``stepper``, train/steps.py: DDP or tensor
parallel, on its device), the optimizer (``opt``: AdamW, or the loss-tolerant one of
``stalwart.comm``), the straggler monitor (``monitor``, ``stalwart.detect``), the work plan
(``work``, ``stalwart.mitigate``) and, in a job that regroups in place, its membership
(``inplace``).

Guarantees:
- deterministic: the same seed gives the same losses (model init from the seed, batches a pure
  function of (seed, step, rank), dropout off); a run resumed from a checkpoint reproduces the
  uninterrupted run's losses;
- per step and rank one metrics line: loss, step time split into compute time and
  communication/wait time, samples, tokens, tokens/s (plus what the comm layer reports);
- each evaluation and checkpoint is done once per step boundary, even when a regroup brings
  the loop back to one it has passed; a checkpoint is LATEST only once every rank's file is
  on disk.

Cost: per step, the batches built on the host and moved to the device, one metrics line, the
monitor's hint and the work plan's step end; a checkpoint adds one barrier.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn

from stalwart import envknobs
from stalwart.config import ConfigError, RunConfig
from stalwart.events import Checkpoint, Devices, Eval, Resumed, RunFinished
from stalwart.rundir import METRICS, EventLog, JsonlWriter
from stalwart.train import checkpoint as ckpt
from stalwart.train.data import Corpus, load_corpus, micro_batch, step_starts, val_batches
from stalwart.train.inplace import REGROUP_PRICE_S, InPlace
from stalwart.train.model import GPT, PRESETS
from stalwart.train.steps import (
    DataParallelStep,
    DetachedStep,
    TensorParallelStep,
    evaluate,
    make_groups,
)
from stalwart.train.torchrun import prepare_run_dir_for_torchrun

if TYPE_CHECKING:
    from stalwart.mitigate.decisions import Decision
    from stalwart.mitigate.rebalance import Assignment


class Stepper(Protocol):
    """The step the rank plugs in (train/steps.py: ``DataParallelStep``,
    ``TensorParallelStep``, ``DetachedStep``)."""

    model: nn.Module

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         micro_weight: float) -> tuple[float, dict[str, float]]:
        """One step's forward and backward over ``batches``, each micro-batch's loss weighted
        by ``micro_weight``: (the mean loss, the step's times: "compute_time", "comm_time",
        ...)."""
        ...

    def clip_grad_norm_(self, max_norm: float) -> None:
        """The gradients clipped to ``max_norm`` by their norm over the whole model."""
        ...

    def close(self) -> None:
        """Let go of what is bound to the current process groups; the model stays."""
        ...

    def interruptible(self) -> None:
        """In a job that regroups in place: from now on its collectives' waits give up when
        the membership watcher interrupts them (a step without such waits: nothing)."""
        ...

    def interrupt(self, why: str) -> None:
        """From any thread (the membership watcher's: a member was lost): the step's waits,
        in progress or before it is bound to new groups, raise with ``why`` instead of
        waiting (once ``interruptible``; a step without such waits: nothing)."""
        ...


@runtime_checkable
class UndoableOptimizer(Protocol):
    """An optimizer that can take back its last update (``stalwart.comm``'s loss-tolerant
    one): in a job that regroups in place, a rank one step ahead of its peers undoes it
    (train/inplace.py). Others (AdamW) apply each update for good."""

    keep_undo: bool  # keep each update's undo record (a copy of the rank's shard)

    def can_undo(self) -> bool:
        """Whether the last update can be undone (``keep_undo``, not undone yet)."""
        ...

    def undo_last(self) -> None:
        """Take the last update back."""
        ...


class WorkPlan(Protocol):
    """The work plan the rank plugs in (``stalwart.mitigate.work_plan``: ``Rebalancer``, or
    ``StaticPlan`` without ``--mitigate`` or with one data-parallel group): which of the
    step's micro-batches this rank computes, and the S3/S4 changes the plan decides (made in
    place by train/inplace.py, or by a restart). Every implementation has every member."""

    # rank 0, once an S3/S4 decision is agreed: the host map, strategy, reason and basis a
    # restart's exit record gives the launcher (train/inplace.py ``leave_for_restart``); None
    # before any and on other ranks
    restart_request: dict[str, Any] | None

    def assign(self, step: int) -> Assignment:
        """This rank's share of ``step``: its global micro-batch indices and their loss
        weight (the same for the same step on every call)."""
        ...

    def normalised(self, compute_s: float) -> float:
        """``compute_s`` (this rank's forward/backward seconds) as if the plan were uniform:
        what the detector is told."""
        ...

    def end_step(self, step: int, compute_s: float, step_s: float) -> None:
        """The step's measurements; at the plan's exchange steps a collective every rank
        makes (a plan that never changes: nothing)."""
        ...

    def restart_due(self, step: int) -> Decision | None:
        """The S3/S4 decision whose start step has come (asked after ``assign``); None: the
        step runs as planned."""
        ...

    def planned_hosts(self, dec: Decision) -> list[int] | None:
        """The rank -> host map ``dec`` (from ``restart_due``) asks for, on every rank; None:
        it takes a restart."""
        ...

    def basis(self, dec: Decision) -> dict[str, Any]:
        """Rank 0: what the gain of ``dec`` made in place is measured against."""
        ...

    def measure_from(self, basis: dict[str, Any] | None, start: int) -> None:
        """After a planned regroup (the plan made again for the new world): measure its gain
        against ``basis`` from step ``start`` (rank 0; elsewhere nothing)."""
        ...

    def close(self) -> None:
        """Let go of the plan's exchange and event log (a regroup makes a new plan)."""
        ...


@runtime_checkable
class ReportingOptimizer(Protocol):
    """An optimizer with metrics of its own per step (``stalwart.comm``'s loss-tolerant one:
    its comm time and loss counters), merged into the step's metrics line. Others (AdamW)
    report nothing."""

    def stats(self) -> dict[str, Any]:
        """The last step's metrics (a "comm_time" among them is added to the step's)."""
        ...


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warmup then cosine decay to 10% of the peak, over cfg.train.steps."""
    peak = cfg.resolved_lr()
    if step < cfg.train.warmup:
        return peak * (step + 1) / cfg.train.warmup
    span = max(cfg.train.steps - cfg.train.warmup, 1)
    progress = min((step - cfg.train.warmup) / span, 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def save_checkpoint(run_dir: Path, done: int, rank: int, cfg: RunConfig, model: nn.Module,
                    opt: Any, events: EventLog) -> None:
    """Every rank saves its file; LATEST moves only once every rank's file is on disk."""
    ckpt.save_rank(run_dir, done, rank, cfg, model, opt)
    dist.barrier()
    if rank == 0:
        ckpt.mark_latest(run_dir, done, world=cfg.job.nproc)
        events.emit(Checkpoint(step=done))


@dataclass
class Rank:
    """One rank's job, built once by ``Rank.start``: the process group and run directory, and
    each capability plugged in as an object -- the step (DDP or tensor parallel, on its
    device), the optimizer (AdamW, or the loss-tolerant one of ``stalwart.comm``), the
    straggler monitor (``stalwart.detect``), the work plan (``stalwart.mitigate``) and, in a
    job that regroups in place, its membership (``inplace``, train/inplace.py)."""

    cfg: RunConfig
    rank: int
    world: int
    device: torch.device
    devices: Any  # the device plan (stalwart.devices.DevicePlan)
    run_dir: Path
    launched: bool  # started by `stalwart run` (else by torchrun)
    events: EventLog
    metrics: JsonlWriter
    corpus: Corpus
    monitor: Any = None
    stepper: Stepper | None = None
    opt: Any = None
    work: WorkPlan | None = None
    val: list = field(default_factory=list)
    data_rank: int = 0
    data_parts: int = 1
    lr: float = 0.0  # this step's learning rate
    n_params: int = 0
    tp_index: int = 0  # the tensor-parallel shard this rank's model holds
    done_at: set = field(default_factory=set)  # ("eval" | "ckpt", step) already done
    inplace: InPlace | None = None  # a job that regroups in place: its membership

    @classmethod
    def start(cls, cfg: RunConfig, link: str | None = None, rejoin: bool = False) -> Rank:
        """Devices, the process group, the run directory and logs, then the capabilities.
        ``link``: the launch's token when the launcher keeps this job's membership
        (elastic/ranklink.py); ``rejoin``: started again to take its host back (``join``).
        ``cfg``: the launcher's resolved configuration (config.json), taken as it is; under
        plain torchrun the command line's options, which rank 0 resolves at torchrun's world
        size for every rank (train/torchrun.py)."""
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        # under plain torchrun the options are not checked yet: a bad count is rank 0's
        # one-line error (below), not torch's
        torch.set_num_threads(max(cfg.job.threads, 1))
        from stalwart.devices import DeviceError, plan_devices, rank_slot, visible_gpus

        slot, slots = rank_slot()
        try:
            dplan = plan_devices(cfg.job.device, slots,
                                 visible_gpus() if cfg.job.device != "cpu" else 0)
        except DeviceError as e:
            raise ConfigError(str(e)) from None
        device = torch.device(dplan.device_of(slot))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if rejoin:
            if link is None:
                raise ConfigError("--rejoin needs --link TOKEN (the launcher gives both)")
            return cls._rejoiner(cfg, rank, device, dplan, link)
        dist.init_process_group(dplan.backend, timeout=timedelta(minutes=5))
        given = envknobs.run_dir()
        launched = given is not None
        if not launched and cfg.testbed.faults:
            raise ConfigError("--fault needs `stalwart run` (the launcher applies faults)")
        if given is not None:
            run_dir = Path(given)
        else:
            cfg = prepare_run_dir_for_torchrun(cfg, rank, world)
            run_dir = cfg.run_dir
            torch.set_num_threads(cfg.job.threads)
        dist.barrier()
        r = cls(cfg, rank, world, device, dplan, run_dir, launched, EventLog(run_dir),
                JsonlWriter(run_dir / METRICS),
                load_corpus(cfg.train.data, cfg.train.max_data_bytes))
        r._plug_in(link)
        return r

    @classmethod
    def _rejoiner(cls, cfg: RunConfig, slot: int, device: torch.device, dplan: Any,
                  link: str) -> Rank:
        """Launch rank ``slot`` started again by the launcher to take its host back in place:
        everything a rank holds but its process groups (those come with the generation that
        takes it back: ``join``)."""
        from stalwart.elastic.ranklink import RankLink
        from stalwart.mitigate.regroup import Regrouper

        given = envknobs.run_dir()
        if given is None:
            raise ConfigError("--rejoin needs `stalwart run` (it names the run directory)")
        run_dir = Path(given)
        r = cls(cfg, slot, 0, device, dplan, run_dir, True, EventLog(run_dir),
                JsonlWriter(run_dir / METRICS),
                load_corpus(cfg.train.data, cfg.train.max_data_bytes))
        torch.manual_seed(cfg.train.seed)
        r.stepper = DetachedStep(GPT(r.model_cfg).to(device))
        r.opt = torch.optim.AdamW(r.stepper.model.parameters(), lr=cfg.resolved_lr(),
                                  betas=(0.9, 0.95), weight_decay=cfg.train.weight_decay)
        with torch.device("meta"):
            r.n_params = sum(p.numel() for p in GPT(r.model_cfg).parameters())
        r.inplace = InPlace(r, Regrouper(RankLink.from_env(link), slot, set(), joining=True),
                            rejoiner=True)
        # what joining builds, imported now: the detector's imports took 2.7 s of a live
        # rejoin's regroup on a loaded machine when left to the regroup itself
        import stalwart.detect  # noqa: F401
        import stalwart.mitigate.rebalance  # noqa: F401
        r.val = [(x.to(device), y.to(device)) for x, y in val_batches(
            r.corpus, cfg.train.eval_batches, cfg.resolved_batch_size(), r.model_cfg.block_size,
            cfg.train.seed)]
        return r

    def enter(self) -> int | None:
        """The step to run next: 0 or a checkpoint's (``resume``), or for a rank started to
        rejoin the step agreed by the generation that takes it back (``join``); None when no
        generation took it back (the caller makes it ``leave``)."""
        if self.inplace is not None and self.inplace.rejoiner:
            try:  # started again to take its host back: in at the agreed step, or out
                # (the evaluation and checkpoint there: as the others agreed, regroup.py)
                return self.inplace.join()
            except RuntimeError as e:
                print(f"stalwart: rank {self.rank} was not taken back: {e}", file=sys.stderr)
                return None
        start = self.resume()
        if start > 0:  # what the resumed checkpoint already holds is not redone
            self.done_at.update({("eval", start), ("ckpt", start)})
        return start

    @property
    def model_cfg(self) -> Any:
        return PRESETS[self.cfg.train.preset]["model"]

    def make_monitor(self, hinted: bool = False,
                     skip_links: set[tuple[int, int]] | None = None) -> Any:
        """The detector's monitor; ``hinted`` (made again by a regroup): the loop's hints are
        its only samples, so its first step is not sampled -- and checked -- from the ops.
        ``skip_links``: rank pairs its validation tests leave out (detect/verify.py)."""
        cfg = self.cfg
        if not cfg.detect.enabled:
            return None
        from stalwart.detect import Monitor

        d = cfg.detect
        lossy = cfg.comm.mode == "lossy"
        # no DDP tracking: every step's hint carries its compute and comm times, so the
        # tracker would record nothing, and its Python comm hook would still take DDP off
        # its C++ all-reduce path (a suspect of the +17% overhead on a GPU, docs/gpu.md)
        return Monitor(
            run_dir=self.run_dir, rank=self.rank, world=self.world, track_ddp=False,
            # lossy: the monitor's gloo ops must not pace the job (monitor.py)
            check_every=d.lossy_check_every if lossy else None,
            lag=d.lossy_lag if lossy else 1, max_every=d.max_every, warmup=d.warmup,
            persist=d.persist, history=d.history, compute_reps=d.compute_reps,
            link_bytes=d.link_bytes, device=self.device, hinted=hinted,
            skip_links=skip_links)

    def _plug_in(self, link: str | None = None) -> None:
        cfg, mcfg, device = self.cfg, self.model_cfg, self.device
        self.monitor = self.make_monitor()
        torch.manual_seed(cfg.train.seed)
        if cfg.train.tp > 1:
            tp_group, dp_group, self.data_rank, self.data_parts = make_groups(self.world,
                                                                              cfg.train.tp)
            self.stepper = TensorParallelStep(cfg, tp_group, dp_group, self.run_dir, device)
            self.tp_index = self.rank % cfg.train.tp
        else:
            self.data_rank, self.data_parts = self.rank, self.world
            self.stepper = DataParallelStep(GPT(mcfg).to(device), device)
        self.opt = self.make_optimizer(self.stepper)
        from stalwart.mitigate import work_plan

        with torch.device("meta"):  # shapes only, no memory: the full model's size over TP
            self.n_params = sum(p.numel() for p in GPT(mcfg).parameters()) // cfg.train.tp
        # a dead peer does not end this rank: it regroups in place (mitigate/regroup.py)
        from stalwart.mitigate.membership import in_place_ok

        if self.launched and self.world > 1 and in_place_ok(cfg) and link is not None:
            from stalwart.elastic.ranklink import RankLink
            from stalwart.mitigate.regroup import Regrouper

            # the first generation's rendezvous store (launch rank 0's TCPStore) is left
            # alone: a regroup never needs it, and shutting its connections would add errors
            self.inplace = InPlace(self, Regrouper(RankLink.from_env(link), self.rank,
                                                   {int(os.environ.get("MASTER_PORT", "0"))}))
            if isinstance(self.opt, UndoableOptimizer):  # the step in flight can be taken back
                self.opt.keep_undo = True
            self.stepper.interruptible()  # TP waits give up on a lost member
        self.work = work_plan(cfg, self.monitor, self.rank, self.world, self.run_dir,
                              self.n_params,
                              REGROUP_PRICE_S if self.inplace is not None else None,
                              self.inplace.regrouper.link if self.inplace is not None else None)
        self.val = [(x.to(device), y.to(device)) for x, y in val_batches(
            self.corpus, cfg.train.eval_batches, cfg.resolved_batch_size(), mcfg.block_size,
            cfg.train.seed)]

    def make_optimizer(self, stepper: Any) -> Any:
        """AdamW on ``stepper``'s model, or with ``--comm lossy`` the loss-tolerant optimizer
        attached to its DDP wrapper (a collective over the current process group): at start
        and after an in-place regroup (train/inplace.py), the same way. In a job that
        regroups in place the lossy optimizer keeps its last update's undo record."""
        cfg = self.cfg
        opt_kw = {"lr": cfg.resolved_lr(), "betas": (0.9, 0.95),
                  "weight_decay": cfg.train.weight_decay}
        if cfg.comm.mode != "lossy":
            return torch.optim.AdamW(stepper.model.parameters(), **opt_kw)
        from stalwart.comm import attach

        # the owners clip the AVERAGED gradient by its global norm: same rule as reliable
        opt = attach(stepper.ddp, torch.optim.AdamW, max_grad_norm=cfg.train.grad_clip,
                     fec=cfg.comm.fec, **opt_kw)
        opt.keep_undo = self.inplace is not None
        return opt

    def resume(self) -> int:
        """The step to start at: 0, or a checkpoint's (``--resume``, a restart)."""
        start = 0
        if self.cfg.job.resume:
            state = ckpt.load_rank(self.run_dir, self.rank, self.cfg, self.device)
            self.stepper.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            ckpt.restore_rng(state)
            start = state["step"]
            if self.rank == 0:
                self.events.emit(Resumed(step=start, world=self.world,
                                         saved_world=state["world"]))
        if self.rank == 0 and start == 0:
            self.events.emit(Devices(plan=self.devices.describe(), device=self.devices.kind,
                                     backend=self.devices.backend))
        return start

    def train_step(self, step: int, share: Any, t0: float) -> tuple[dict[str, Any], float]:
        """Forward/backward over this rank's share of the step, the optimizer step; the
        metrics line and the forward/backward seconds."""
        cfg, mcfg = self.cfg, self.model_cfg
        mbs, gb = cfg.resolved_micro_batch_size(), cfg.resolved_global_batch()
        starts = step_starts(self.corpus, gb, mcfg.block_size, cfg.train.seed, step)
        batches = [micro_batch(self.corpus, starts, mbs, mcfg.block_size, g)
                   for g in share.indices]
        batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        loss, timing = self.stepper.forward_backward(batches, share.micro_weight)
        t_opt = time.perf_counter()
        if cfg.comm.mode != "lossy":  # lossy: clipped inside opt.step() (attach max_grad_norm)
            self.stepper.clip_grad_norm_(cfg.train.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.inplace is not None:
            self.inplace.stepped()
        t1 = time.perf_counter()
        # by the class: isinstance with a runtime Protocol reads the Protocol's members again
        # on every call (30-65 us per step on Python 3.11), issubclass is cached (~1.5 us)
        extra: dict[str, Any] = self.opt.stats() \
            if issubclass(type(self.opt), ReportingOptimizer) else {}
        opt_comm = float(extra.pop("comm_time", 0.0))
        tokens = mbs * len(batches) * mcfg.block_size
        step_time = t1 - t0
        fb = timing["compute_time"]  # forward/backward: the part that scales with the plan
        rec = {
            "step": step, "rank": self.rank, "time": time.time(), "loss": loss,
            "lr": self.lr, "step_time": step_time,
            "compute_time": fb + (t1 - t_opt) - opt_comm,
            # replay rebuilds the detector's and the policy's per-micro-batch inputs from it
            "fb_time": fb,
            "comm_time": timing["comm_time"] + opt_comm,
            "samples": mbs * len(batches), "tokens": tokens, "tokens_per_s": tokens / step_time,
            "micro_batches": len(batches), "plan_version": share.version,
            "host": cfg.job.hosts[self.rank] if cfg.job.hosts else self.rank, "world": self.world,
            **{k: v for k, v in timing.items() if k not in ("compute_time", "comm_time")},
            **extra,
        }
        return rec, fb

    def record(self, step: int, rec: dict[str, Any], fb: float) -> None:
        """The metrics line; the monitor's hint (per unit of work: a plan must not look like a
        recovery) and the work plan's measurements."""
        self.metrics.write(rec)
        if self.monitor is not None:
            self.monitor.step(step, {**rec, "compute_time": rec["compute_time"] - fb
                                     + self.work.normalised(fb)})
        self.work.end_step(step, fb, rec["step_time"])

    def restart_due(self, step: int) -> bool:
        """Whether an S3/S4 decision starts at ``step`` and takes a restart. In a job that
        regroups in place it is announced instead and PlannedRegroup raised on every rank
        (``InPlace.planned``), so that the loop regroups."""
        due = self.work.restart_due(step)
        if due is None:
            return False
        return self.inplace is None or self.inplace.planned(due, step)

    # ---- the seams a regroup rebuilds the rank through (train/inplace.py) ------------------
    def release(self) -> None:
        """Before new groups: the failed step's partial gradients dropped, the step, monitor
        and work plan closed (their exchanges failed with the old groups)."""
        self.opt.zero_grad(set_to_none=True)
        self.stepper.close()
        for part in (self.monitor, self.work):
            with contextlib.suppress(Exception):
                if part is not None:
                    part.close()
        self.monitor = self.work = None

    def place(self, rank: int, world: int, data_rank: int, data_parts: int,
              tp_index: int | None = None) -> None:
        """This rank's place in the new world: its rank, the world, its data shard (and its
        tensor-parallel index, once its shard is there)."""
        self.rank, self.world, self.data_rank, self.data_parts = rank, world, data_rank, \
            data_parts
        if tp_index is not None:
            self.tp_index = tp_index

    def plug(self, stepper: Stepper | None = None, opt: Any = None, monitor: Any = None,
             work: WorkPlan | None = None) -> None:
        """The new world's step, optimizer, monitor or work plan (each given one replaces
        the rank's)."""
        if stepper is not None:
            self.stepper = stepper
        if opt is not None:
            self.opt = opt
        if monitor is not None:
            self.monitor = monitor
        if work is not None:
            self.work = work

    def set_lr(self, step: int) -> None:
        self.lr = lr_at(step, self.cfg)
        for g in self.opt.param_groups:
            g["lr"] = self.lr

    def evaluate(self, step: int) -> None:
        t = time.perf_counter()
        v = evaluate(self.stepper.model, self.val, self.data_rank, self.data_parts)
        if self.rank == 0:
            self.events.emit(Eval(step=step, val_loss=v, eval_time=time.perf_counter() - t))

    def checkpoint(self, step: int) -> None:
        save_checkpoint(self.run_dir, step, self.rank, self.cfg, self.stepper.model, self.opt,
                        self.events)

    def after(self, done: int) -> None:
        """The evaluation and checkpoint due after ``done`` steps, each once (a regroup can
        bring the loop back to a step boundary it has passed)."""
        cfg = self.cfg
        if (done == 0 or done % cfg.train.eval_every == 0 or done == cfg.train.steps) \
                and ("eval", done) not in self.done_at:
            self.evaluate(done)
            self.done_at.add(("eval", done))
        t = cfg.train
        if (done % t.ckpt_every == 0 or done == t.steps or done == t.halt_at) \
                and done > 0 and ("ckpt", done) not in self.done_at:
            self.checkpoint(done)
            self.done_at.add(("ckpt", done))

    def finish(self, code: int) -> int:
        for part in (self.monitor, self.work, self.opt, self.inplace):
            if hasattr(part, "close"):
                part.close()
        dist.barrier()
        if self.rank == 0 and not self.launched and code == 0:
            self.events.emit(RunFinished(ok=True))
            from stalwart.report import build_report

            build_report(self.run_dir)
        self.metrics.close()
        self.events.close()
        dist.destroy_process_group()
        return code
