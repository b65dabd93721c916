"""The step capability: one rank's forward/backward over its micro-batches, as an object the
rank plugs in -- ``DataParallelStep`` (DDP, reliable or lossy comm), ``TensorParallelStep``
(stalwart.overlap), ``DetachedStep`` (a rank started to rejoin, before it has groups) -- with
the TP/DP group layout (``make_groups``) and the validation loss (``evaluate``).

Seam (``rank.Stepper``): ``stepper.model``, ``stepper.forward_backward(batches,
micro_weight) -> (loss, timing)``, ``stepper.clip_grad_norm_(max_norm)``, ``stepper.close()``
(a regroup lets go of the old groups' wrapper; TP: ``stepper.rebind(tp_group, dp_group)``),
``stepper.interruptible()`` and ``stepper.interrupt(why)`` (a job that regroups in place).

Guarantees:
- ``timing`` splits the step into "compute_time" and "comm_time" (TP adds what the overlap
  schedule reports); on CUDA the split is the device's own clock when its events are complete;
- the loss is the same float64 sum over the micro-batches on CPU and CUDA;
- every rank creates every TP and DP group in the same order (torch.distributed's rule).

How the step time is split (data parallel): DDP all-reduces gradient buckets while backward
still runs, so "communication" here is the time the rank spends after its own last gradient was
computed until the reduced gradients are available -- the wait a slow peer or a slow link
causes. The end of local computation is taken from the last post-accumulate-grad hook.

Cost: per step, one host timestamp per parameter gradient (the hooks); on CUDA four event
records and one device-to-host transfer of the micro-batch losses, no extra sync. An
evaluation: one all-reduce of two numbers.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from stalwart.config import RunConfig
from stalwart.train.model import GPT, PRESETS


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

    def interruptible(self) -> None:
        """Nothing: DDP's waits are not interrupted (a lost member fails its collective)."""

    def interrupt(self, why: str) -> None:
        """Nothing, as ``interruptible``."""

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

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         micro_weight: float) -> tuple[float, dict[str, float]]:
        """Never: RuntimeError (no process group to step in until it joins)."""
        raise RuntimeError("a rank waiting to rejoin has no step to take")

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Never: RuntimeError, as ``forward_backward``."""
        raise RuntimeError("a rank waiting to rejoin has no gradients to clip")

    def interruptible(self) -> None:
        """Nothing: it has no collectives."""

    def interrupt(self, why: str) -> None:
        """Nothing: it has no collectives."""

    def close(self) -> None:
        pass


class TensorParallelStep:
    """Tensor-parallel forward/backward from stalwart.overlap (sequential or interleaved)."""

    def __init__(self, cfg: RunConfig, tp_group: Any, dp_group: Any, run_dir: Path,
                 device: torch.device) -> None:
        from stalwart.overlap import build_tp_trainer

        self.trainer = build_tp_trainer(PRESETS[cfg.train.preset]["model"], tp_group, dp_group,
                                        cfg.overlap.mode, run_dir, device=device)
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

    def interruptible(self) -> None:
        """Its collectives' waits give up when ``interrupt`` is called (a job that regroups
        in place; overlap/comm.py ``TPComm.await_work``)."""
        self.trainer.comm.interruptible = True

    def interrupt(self, why: str) -> None:
        """From any thread: its collectives in flight, and any issued before the next
        ``rebind``, raise RuntimeError with ``why`` instead of waiting (once
        ``interruptible``)."""
        self.trainer.comm.interrupt(why)


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
