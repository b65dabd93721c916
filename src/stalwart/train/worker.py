"""One rank's training loop: init, DDP (or tensor parallel), step, eval, checkpoint, metrics.

Started by ``stalwart run`` (``--config RUN_DIR/config.json``) or directly by torchrun with the
same options as ``stalwart run``::

    torchrun --standalone --nproc-per-node 2 -m stalwart.train.worker --steps 100 --name demo

Guarantees:
- deterministic: the same seed gives the same losses (model init from the seed, batches a pure
  function of (seed, step, rank), dropout off); a run resumed from a checkpoint reproduces the
  uninterrupted run's losses;
- per step and rank one metrics line: loss, step time split into compute time and
  communication/wait time, samples, tokens, tokens/s (plus what the comm layer reports);
- a ConfigError (bad checkpoint, bad option) exits with code 2 and one line on stderr.

How the step time is split (data parallel): DDP all-reduces gradient buckets while backward
still runs, so "communication" here is the time the rank spends after its own last gradient was
computed until the reduced gradients are available -- the wait a slow peer or a slow link
causes. The end of local computation is taken from the last post-accumulate-grad hook.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from stalwart.config import ConfigError, RunConfig
from stalwart.rundir import METRICS, EventLog, JsonlWriter
from stalwart.train import checkpoint as ckpt
from stalwart.train.data import Corpus, load_corpus, micro_batch, step_starts, val_batches
from stalwart.train.model import GPT, PRESETS

# S3/S4's price while no in-place regroup has been measured yet in this job: 0.6-0.9 s
# measured on the netns testbed (4 ranks on 2 cores), rounded up
REGROUP_PRICE_S = 1.0


MAX_REGROUPS = 8  # membership changes in a row a regroup follows before the rank gives up
JOIN_WAIT_S = 120.0  # a rank started to rejoin gives up (and leaves) after this long


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warmup then cosine decay to 10% of the peak, over cfg.steps."""
    peak = cfg.resolved_lr()
    if step < cfg.warmup:
        return peak * (step + 1) / cfg.warmup
    span = max(cfg.steps - cfg.warmup, 1)
    progress = min((step - cfg.warmup) / span, 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


class LocalComputeClock:
    """Records when this rank's last gradient was computed (post-accumulate-grad hooks).

    On CUDA the host time of a hook is when autograd *enqueued* that gradient, not when the
    device computed it, so the clock also records a CUDA event there -- only in the hook of
    the parameter whose gradient came last in the previous step (the graph's order is fixed),
    so a step costs one event record, not one per parameter. ``device_times`` reads the events
    once they are complete: after the loop's own sync (the loss), never by syncing for them.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.last = 0.0
        self.cuda = device.type == "cuda"
        self._last_param = -1  # index of the parameter whose gradient came last
        self._seen = -1
        if self.cuda:
            self._ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        self._hooks = [p.register_post_accumulate_grad_hook(lambda _p, i=i: self._mark(i))
                       for i, p in enumerate(model.parameters()) if p.requires_grad]

    def close(self) -> None:
        """Remove the hooks (a regroup wraps the same model again)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _mark(self, i: int) -> None:
        self.last = time.perf_counter()
        self._seen = i
        if self.cuda and i == self._last_param:
            self._ev[1].record()  # on the stream that produced this gradient

    def start(self) -> None:
        if self.cuda:
            self._ev[1].record()  # a step whose last hook differs still has a valid event
            self._ev[0].record()

    def backward_done(self) -> None:
        if self.cuda:
            self._ev[2].record()

    def device_times(self) -> tuple[float, float] | None:
        """(compute, comm) seconds on the device for the step just run; None on CPU, or when
        the events are not complete yet (the caller keeps its host times)."""
        first = self._last_param != self._seen
        self._last_param = self._seen  # learn the order for the next step
        if not self.cuda or first or not self._ev[2].query():
            return None
        e0, e1, e2 = self._ev
        return e0.elapsed_time(e1) / 1e3, e1.elapsed_time(e2) / 1e3


class DataParallelStep:
    """Forward/backward over the step's micro-batches with DDP (reliable or lossy comm)."""

    def __init__(self, model: GPT, device: torch.device) -> None:
        self.ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.model = model
        self.clock = LocalComputeClock(model, device)

    def clip_grad_norm_(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def close(self) -> None:
        """Let go of the DDP wrapper and the clock's hooks; the model stays as it is (a
        second call does nothing: a regroup that failed half-way is retried)."""
        if not hasattr(self, "ddp"):
            return
        self.clock.close()
        # the reducer's hooks on the parameters would otherwise fire (on the old process
        # group) until a garbage collection frees it -- and a full collection costs ~0.5 s
        self.ddp._remove_autograd_hooks()
        del self.ddp

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         micro_weight: float) -> tuple[float, dict[str, float]]:
        """``micro_weight``: each micro-batch loss's weight (G/M, mitigate/rebalance.py), so
        DDP's average over the G ranks is the mean over the step's M micro-batches."""
        t0 = time.perf_counter()
        self.clock.last = t0
        self.clock.start()
        losses = []
        for i, (x, y) in enumerate(batches):
            sync = i == len(batches) - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                _, loss = self.ddp(x, y)
                (loss * micro_weight).backward()
            # CPU: read at once (as always); CUDA: no host sync per micro-batch
            losses.append(loss.item() if not self.clock.cuda else loss.detach())
        self.clock.backward_done()
        if self.clock.cuda:  # one transfer for the step; the same float64 sum as on CPU
            losses = torch.stack(losses).double().cpu().tolist()
        total = sum(losses)
        t1 = time.perf_counter()
        local_done = min(max(self.clock.last, t0), t1)
        timing = {"compute_time": local_done - t0, "comm_time": t1 - local_done}
        dev = self.clock.device_times()
        if dev is not None:  # the device's own clock: what the GPU did, not what was enqueued
            timing["compute_time"], timing["comm_time"] = dev
            timing["host_time"] = t1 - t0
        return total / len(batches), timing


class DetachedStep:
    """A rank started again to rejoin, before it is in a process group: its model only (DDP
    wraps it when it joins, as every rank's after a regroup)."""

    def __init__(self, model: GPT) -> None:
        self.model = model

    def close(self) -> None:
        pass


class TensorParallelStep:
    """Tensor-parallel forward/backward from stalwart.overlap (sequential or interleaved)."""

    def __init__(self, cfg: RunConfig, tp_group: Any, dp_group: Any, run_dir: Path,
                 device: torch.device) -> None:
        from stalwart.overlap import build_tp_trainer

        self.trainer = build_tp_trainer(PRESETS[cfg.preset]["model"], tp_group, dp_group,
                                        cfg.overlap, run_dir, device=device)
        self.model = self.trainer.model

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         micro_weight: float) -> tuple[float, dict[str, float]]:
        loss, timings = self.trainer.forward_backward(batches, micro_weight)
        return float(loss), dict(timings)

    def clip_grad_norm_(self, max_norm: float) -> None:
        # the norm over the whole model, not this rank's shards: replicated weights must get
        # the same coefficient on every TP rank or the replicas drift apart
        self.trainer.clip_grad_norm_(max_norm)

    def close(self) -> None:
        """Nothing to let go between two steps: a regroup rebinds the same trainer."""

    def rebind(self, tp_group: Any, dp_group: Any) -> None:
        """The new generation's TP and DP groups (an in-place regroup)."""
        self.trainer.rebind(tp_group, dp_group)


def make_groups(world: int, tp: int) -> tuple[Any, Any, int, int]:
    """TP groups of consecutive ranks, DP groups of equal TP index; (tp_g, dp_g, dp_rank, dp_n).

    Every rank must create every group, in the same order (torch.distributed's rule).
    """
    rank = dist.get_rank()
    tp_group = dp_group = None
    for start in range(0, world, tp):
        g = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            tp_group = g
    for i in range(tp):
        g = dist.new_group(list(range(i, world, tp)))
        if rank % tp == i:
            dp_group = g
    return tp_group, dp_group, rank // tp, world // tp


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, part: int, parts: int) -> float:
    """Mean validation loss; the fixed batches are split over the data-parallel ranks."""
    model.eval()
    acc = torch.zeros(2, dtype=torch.float64)
    for i, (x, y) in enumerate(batches):
        if i % parts == part:
            _, loss = model(x, y)
            acc += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
    model.train()
    dist.all_reduce(acc)  # TP ranks of a group add identical values: the ratio is unchanged
    return float(acc[0] / acc[1])


def prepare_run_dir_for_torchrun(cfg: RunConfig, rank: int) -> Path:
    """Under torchrun (no launcher), rank 0 sets up the run directory the launcher would, and
    every rank takes its decisions (resume or not, global batch) so that none can differ.

    Elastic jobs (``torchrun --nnodes MIN:MAX``): when a node leaves or joins, torchrun stops
    every worker and starts them again at the new WORLD_SIZE with TORCHELASTIC_RESTART_COUNT
    > 0. Such an incarnation, like one started with --resume, continues from the latest
    checkpoint -- or starts at step 0 when there is none yet (the first incarnation may die
    before its first checkpoint; failing would only burn torchrun's restarts). The global
    batch and micro-batch size are resolved once, by the first incarnation, and kept in
    config.json: every later incarnation trains on the same samples per step whatever its
    world size (more or fewer micro-batches per rank), which is what the checkpoint's
    fingerprint requires.
    """
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    # a node that joins later starts at restart count 0 while the others restart: one rank's
    # restart makes the whole new world resume. all_gather_object works on gloo and NCCL.
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, cfg.resume or restarted > 0)
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = _torchrun_run_dir(cfg, any(flags), restarted)
        except ConfigError as e:
            box[0] = str(e)  # every rank raises it: one line and exit 2 everywhere, no hang
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ConfigError(box[0])
    cfg.global_batch, cfg.micro_batch_size, cfg.resume = box[0]
    cfg.validate()  # e.g. too few micro-batches for a larger new world
    return cfg.run_dir


def _torchrun_run_dir(cfg: RunConfig, resume: bool, restarted: int) -> tuple[int, int, bool]:
    """Rank 0's part: (global batch, micro-batch size, resume from a checkpoint)."""
    from stalwart.config import check_writable
    from stalwart.rundir import CHECKPOINTS, CONFIG, EVENTS

    run_dir = cfg.run_dir
    check_writable(run_dir)
    if resume and (run_dir / CONFIG).exists():
        first = RunConfig.load(run_dir / CONFIG)
        # values given on this command line win (the checkpoint's fingerprint checks them)
        if cfg.global_batch is None:
            cfg.global_batch = first.global_batch
        if cfg.micro_batch_size is None:
            cfg.micro_batch_size = first.micro_batch_size
    elif not resume and ((run_dir / METRICS).exists() or (run_dir / EVENTS).exists()):
        raise ConfigError(f"run directory already holds a run: {run_dir} "
                          "(pass --resume to continue it, or another --name)")
    cfg.global_batch = cfg.resolved_global_batch()
    cfg.micro_batch_size = cfg.resolved_micro_batch_size()
    cfg.validate()
    from_ckpt = resume and ckpt.has_checkpoint(run_dir)
    cfg.resume = from_ckpt
    cfg.save(run_dir / CONFIG)  # this incarnation's world size, the first one's global batch
    if not from_ckpt:
        if resume:
            print(f"stalwart: no checkpoint in {run_dir / CHECKPOINTS} yet: starting at step 0",
                  file=sys.stderr)
        events = EventLog(run_dir)
        events.log("run_started", nproc=cfg.nproc, launcher="torchrun", restart=restarted)
        events.close()
    return cfg.global_batch, cfg.micro_batch_size, from_ckpt


def save_checkpoint(run_dir: Path, done: int, rank: int, cfg: RunConfig, model: nn.Module,
                    opt: Any, events: EventLog) -> None:
    """Every rank saves its file; LATEST moves only once every rank's file is on disk."""
    ckpt.save_rank(run_dir, done, rank, cfg, model, opt)
    dist.barrier()
    if rank == 0:
        ckpt.mark_latest(run_dir, done, world=cfg.nproc)
        events.log("checkpoint", step=done)


@dataclass
class Rank:
    """One rank's job, built once by ``Rank.start``: the process group and run directory, and
    each capability plugged in as an object -- the step (DDP or tensor parallel, on its
    device), the optimizer (AdamW, or the loss-tolerant one of ``stalwart.comm``), the
    straggler monitor (``stalwart.detect``) and the work plan (``stalwart.mitigate``)."""

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
    stepper: Any = None
    opt: Any = None
    work: Any = None
    val: list = field(default_factory=list)
    data_rank: int = 0
    data_parts: int = 1
    lr: float = 0.0  # this step's learning rate
    regrouper: Any = None  # a job that regroups in place (mitigate/regroup.py)
    joining: bool = False  # started again by the launcher to rejoin (a host taken back)
    n_params: int = 0
    agreed: int = -1  # the steps applied that the last regroup's state agreement settled on
    tp_index: int = 0  # the tensor-parallel shard this rank's model holds
    done_at: set = field(default_factory=set)  # ("eval" | "ckpt", step) already done

    @classmethod
    def start(cls, cfg: RunConfig) -> Rank:
        """Devices, the process group, the run directory and logs, then the capabilities."""
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != cfg.nproc:
            cfg.nproc = world  # torchrun decides the world size
        cfg.validate()
        torch.set_num_threads(cfg.threads)
        from stalwart.devices import DeviceError, plan_devices, rank_slot, visible_gpus

        slot, slots = rank_slot()
        try:
            dplan = plan_devices(cfg.device, slots, visible_gpus() if cfg.device != "cpu" else 0)
        except DeviceError as e:
            raise ConfigError(str(e)) from None
        device = torch.device(dplan.device_of(slot))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        from stalwart.mitigate.membership import JOIN_ENV

        if os.environ.get(JOIN_ENV) == "1":
            return cls._rejoiner(cfg, rank, device, dplan)
        dist.init_process_group(dplan.backend, timeout=timedelta(minutes=5))
        launched = "STALWART_RUN_DIR" in os.environ
        if not launched and cfg.faults:
            raise ConfigError("--fault needs `stalwart run` (the launcher applies faults)")
        if launched:
            run_dir = Path(os.environ["STALWART_RUN_DIR"])
        else:
            run_dir = prepare_run_dir_for_torchrun(cfg, rank)
        dist.barrier()
        r = cls(cfg, rank, world, device, dplan, run_dir, launched, EventLog(run_dir),
                JsonlWriter(run_dir / METRICS), load_corpus(cfg.data, cfg.max_data_bytes))
        r._plug_in()
        return r

    @classmethod
    def _rejoiner(cls, cfg: RunConfig, slot: int, device: torch.device, dplan: Any) -> Rank:
        """Launch rank ``slot`` started again by the launcher to take its host back in place:
        everything a rank holds but its process groups (those come with the generation that
        takes it back: ``join``)."""
        from stalwart.mitigate.regroup import Regrouper

        run_dir = Path(os.environ["STALWART_RUN_DIR"])
        r = cls(cfg, slot, 0, device, dplan, run_dir, True, EventLog(run_dir),
                JsonlWriter(run_dir / METRICS), load_corpus(cfg.data, cfg.max_data_bytes))
        r.joining = True
        torch.manual_seed(cfg.seed)
        r.stepper = DetachedStep(GPT(r.model_cfg).to(device))
        r.opt = torch.optim.AdamW(r.stepper.model.parameters(), lr=cfg.resolved_lr(),
                                  betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        with torch.device("meta"):
            r.n_params = sum(p.numel() for p in GPT(r.model_cfg).parameters())
        r.regrouper = Regrouper(run_dir, slot, set(), joining=True)
        # what joining builds, imported now: the detector's imports (scipy) took 2.7 s of a
        # live rejoin's regroup on a loaded machine when left to the regroup itself
        import stalwart.detect  # noqa: F401
        import stalwart.mitigate.rebalance  # noqa: F401
        r.val = [(x.to(device), y.to(device)) for x, y in val_batches(
            r.corpus, cfg.eval_batches, cfg.resolved_batch_size(), r.model_cfg.block_size,
            cfg.seed)]
        return r

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

    @property
    def model_cfg(self) -> Any:
        return PRESETS[self.cfg.preset]["model"]

    def _make_monitor(self, hinted: bool = False) -> Any:
        """The detector's monitor; ``hinted`` (made again by a regroup): the loop's hints are
        its only samples, so its first step is not sampled -- and checked -- from the ops."""
        cfg = self.cfg
        if not cfg.detect:
            return None
        from stalwart.detect import Monitor

        d = cfg.detection
        lossy = cfg.comm == "lossy"
        # no DDP tracking: every step's hint carries its compute and comm times, so the
        # tracker would record nothing, and its Python comm hook would still take DDP off
        # its C++ all-reduce path (a suspect of the +17% overhead on a GPU, docs/gpu.md)
        return Monitor(
            run_dir=self.run_dir, rank=self.rank, world=self.world, track_ddp=False,
            # lossy: the monitor's gloo ops must not pace the job (monitor.py)
            check_every=d.lossy_check_every if lossy else None,
            lag=d.lossy_lag if lossy else 1, max_every=d.max_every, warmup=d.warmup,
            persist=d.persist, history=d.history, compute_reps=d.compute_reps,
            link_bytes=d.link_bytes, device=self.device, hinted=hinted)

    def _plug_in(self) -> None:
        cfg, mcfg, device = self.cfg, self.model_cfg, self.device
        self.monitor = self._make_monitor()
        torch.manual_seed(cfg.seed)
        if cfg.tp > 1:
            tp_group, dp_group, self.data_rank, self.data_parts = make_groups(self.world, cfg.tp)
            self.stepper = TensorParallelStep(cfg, tp_group, dp_group, self.run_dir, device)
            self.tp_index = self.rank % cfg.tp
        else:
            self.data_rank, self.data_parts = self.rank, self.world
            self.stepper = DataParallelStep(GPT(mcfg).to(device), device)
        opt_kw = {"lr": cfg.resolved_lr(), "betas": (0.9, 0.95),
                  "weight_decay": cfg.weight_decay}
        if cfg.comm == "lossy":
            from stalwart.comm import attach

            # the owners clip the AVERAGED gradient by its global norm: same rule as reliable
            self.opt = attach(self.stepper.ddp, torch.optim.AdamW, max_grad_norm=cfg.grad_clip,
                              **opt_kw)
        else:
            self.opt = torch.optim.AdamW(self.stepper.model.parameters(), **opt_kw)
        from stalwart.mitigate import work_plan

        with torch.device("meta"):  # shapes only, no memory: the full model's size over TP
            self.n_params = sum(p.numel() for p in GPT(mcfg).parameters()) // cfg.tp
        # a dead peer does not end this rank: it regroups in place (mitigate/regroup.py)
        from stalwart.mitigate.membership import in_place_ok

        if self.launched and self.world > 1 and in_place_ok(cfg):
            from stalwart.mitigate.regroup import Regrouper

            # the first generation's rendezvous store (launch rank 0's TCPStore) is left
            # alone: a regroup never needs it, and shutting its connections would add errors
            self.regrouper = Regrouper(self.run_dir, self.rank,
                                       {int(os.environ.get("MASTER_PORT", "0"))})
        self.work = work_plan(cfg, self.monitor, self.rank, self.world, self.run_dir,
                              self.n_params,
                              REGROUP_PRICE_S if self.regrouper is not None else None)
        self.val = [(x.to(device), y.to(device)) for x, y in val_batches(
            self.corpus, cfg.eval_batches, cfg.resolved_batch_size(), mcfg.block_size,
            cfg.seed)]

    def resume(self) -> int:
        """The step to start at: 0, or a checkpoint's (``--resume``, a restart)."""
        start = 0
        if self.cfg.resume:
            state = ckpt.load_rank(self.run_dir, self.rank, self.cfg, self.device)
            self.stepper.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            ckpt.restore_rng(state)
            start = state["step"]
            if self.rank == 0:
                self.events.log("resumed", step=start, world=self.world,
                                saved_world=state["world"])
        if self.rank == 0 and start == 0:
            self.events.log("devices", plan=self.devices.describe(), device=self.devices.kind,
                            backend=self.devices.backend)
        return start

    def train_step(self, step: int, share: Any, t0: float) -> tuple[dict[str, Any], float]:
        """Forward/backward over this rank's share of the step, the optimizer step; the
        metrics line and the forward/backward seconds."""
        cfg, mcfg = self.cfg, self.model_cfg
        mbs, gb = cfg.resolved_micro_batch_size(), cfg.resolved_global_batch()
        starts = step_starts(self.corpus, gb, mcfg.block_size, cfg.seed, step)
        batches = [micro_batch(self.corpus, starts, mbs, mcfg.block_size, g)
                   for g in share.indices]
        batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        loss, timing = self.stepper.forward_backward(batches, share.micro_weight)
        t_opt = time.perf_counter()
        if cfg.comm != "lossy":  # lossy: clipped inside opt.step() (attach max_grad_norm)
            self.stepper.clip_grad_norm_(cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        extra: dict[str, Any] = self.opt.stats() if hasattr(self.opt, "stats") else {}
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
            "host": cfg.hosts[self.rank] if cfg.hosts else self.rank, "world": self.world,
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

    def set_lr(self, step: int) -> None:
        self.lr = lr_at(step, self.cfg)
        for g in self.opt.param_groups:
            g["lr"] = self.lr

    def evaluate(self, step: int) -> None:
        t = time.perf_counter()
        v = evaluate(self.stepper.model, self.val, self.data_rank, self.data_parts)
        if self.rank == 0:
            self.events.log("eval", step=step, val_loss=v, eval_time=time.perf_counter() - t)

    def checkpoint(self, step: int) -> None:
        save_checkpoint(self.run_dir, step, self.rank, self.cfg, self.stepper.model, self.opt,
                        self.events)

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

    def after(self, done: int) -> None:
        """The evaluation and checkpoint due after ``done`` steps, each once (a regroup can
        bring the loop back to a step boundary it has passed)."""
        cfg = self.cfg
        if (done == 0 or done % cfg.eval_every == 0 or done == cfg.steps) \
                and ("eval", done) not in self.done_at:
            self.evaluate(done)
            self.done_at.add(("eval", done))
        if (done % cfg.ckpt_every == 0 or done == cfg.steps or done == cfg.halt_at) \
                and done > 0 and ("ckpt", done) not in self.done_at:
            self.checkpoint(done)
            self.done_at.add(("ckpt", done))

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

        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:240]
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

    def finish(self, code: int) -> int:
        for part in (self.monitor, self.work, self.opt, self.regrouper):
            if hasattr(part, "close"):
                part.close()
        dist.barrier()
        if self.rank == 0 and not self.launched and code == 0:
            self.events.log("run_finished", ok=True)
            from stalwart.report import build_report

            build_report(self.run_dir)
        self.metrics.close()
        self.events.close()
        dist.destroy_process_group()
        return code


def train(cfg: RunConfig) -> int:
    """The rank loop: each step's share of the work, its forward/backward and optimizer step,
    its measurements to the metrics, the monitor and the plan; evaluations and checkpoints.
    In a job that regroups in place a failed collective (a rank lost) or a planned change
    (S3/S4) rebuilds the rank's groups and the loop goes on at the agreed step: at most the
    step in flight is redone (``Rank.regroup``)."""
    from stalwart.mitigate import RESTART_EXIT
    from stalwart.mitigate.regroup import NotAMember, is_comm_error

    r = Rank.start(cfg)
    if r.joining:  # started again to take its host back: in at the agreed step, or out
        try:
            start = r.join()
        except RuntimeError as e:
            print(f"stalwart: rank {r.rank} was not taken back: {e}", file=sys.stderr)
            return r.leave()
    else:
        start = r.resume()
    stop = cfg.halt_at if cfg.halt_at is not None else cfg.steps
    applied = start  # optimizer steps applied: the next step to run
    if start > 0:  # what the resumed checkpoint already holds is not redone
        r.done_at.update({("eval", start), ("ckpt", start)})
    while True:
        try:
            r.after(applied)
            if applied >= stop:
                break
            step = applied
            t0 = time.perf_counter()
            r.set_lr(step)
            share = r.work.assign(step)  # which of the step's micro-batches this rank computes
            if r.restart_due(step):  # S3/S4 (in place, they raise PlannedRegroup)
                r.checkpoint(step)
                return r.finish(RESTART_EXIT)
            rec, fb = r.train_step(step, share, t0)
            applied = step + 1
            r.record(step, rec, fb)
        except Exception as e:  # noqa: BLE001 -- only a failed collective is handled here
            if r.regrouper is None or not (r.regrouper.changed() or is_comm_error(e)):
                raise
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:240]
            del e  # its traceback holds the failed step's graph, and with it the old DDP
            try:
                applied = regroup_until_done(r, applied, why)
            except NotAMember:  # left out by the plan (S4): its host is probed from outside
                return r.leave()
            except Exception as e:  # noqa: BLE001 -- any failure: checkpoint-and-relaunch
                return r.fall_back(applied, e)
    if cfg.halt_at is not None and r.rank == 0:
        r.events.log("halted", step=cfg.halt_at)
    return r.finish(0)


def regroup_until_done(r: Rank, applied: int, why: str) -> int:
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["--config"] and len(argv) >= 2:
            cfg = RunConfig.load(Path(argv[1]))
        else:
            from stalwart.runargs import config_from_run_args

            cfg = config_from_run_args(argv)
        return train(cfg)
    except ConfigError as e:
        print(f"stalwart: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
