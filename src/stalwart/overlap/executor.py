"""``Interleaved``: one training step over micro-batches, sequential or strand-interleaved.

Mechanism (DHelix strand interleaving, arXiv 2411.15871): with micro-batches 0..M-1, the
forward of micro-batch k+1 is co-executed with the backward of micro-batch k (two strands,
``strands.py``). F(0) has no partner and runs alone; then a forward strand runs F(1..M-1) and a
backward strand B(0..M-1), each pass after pass, in the segment order the plan search chose
for the whole step (``plan.stream_profile`` + ``plan.search``, from the per-pass profile of
``profiler.py``; B(k) never starts before F(k) is done). The schedules, all over the same
model object (one copy of the weights):

* ``"off"``   -- micro-batches one after the other, every collective waited at once;
* ``"async"`` -- one after the other, each layer overlapping its own collective with its own
  remaining work (intra-micro-batch overlap: the baseline);
* ``"si"``    -- strand interleaving, with split backward: the parallel layers' weight-gradient
  GEMMs are deferred into a queue and run while a strand waits for a collective (``wgrad.py``),
  and optionally chunked collectives (``TPComm.start_matmul``).

The predicted step time (``predicted_step_time``) comes from ``plan.simulate_step``: the DP's
plan (searched twice: with the weight-gradient work as a separate pool and inside its segments)
replayed on one compute thread, one link shared by both strands' collectives, and the pool.

Guarantees: every schedule runs the same arithmetic per micro-batch and accumulates gradients
in the same micro-batch order, so the gradients after a step are the same (1e-5 in tests; in
practice bitwise); they are the mean over micro-batches and, when a data-parallel group of size
> 1 is given, the mean over it. The plan is identical on all ranks of the TP group (profiles
are max-reduced, a reused plan is checked by hash), as gloo's matching of collectives needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from stalwart.overlap.comm import TPComm, current_strand
from stalwart.overlap.memory import SavedTensorMeter
from stalwart.overlap.plan import (
    Plan,
    Profile,
    load_plan,
    make_plan,
    save_plan,
    search,
    simulate_step,
    stream_profile,
)
from stalwart.overlap.profiler import count_segments, profile_pairs
from stalwart.overlap.strands import Strand, run_plan
from stalwart.overlap.wgrad import WGradQueue

SCHEDULES = ("off", "async", "si")
MicroBatch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _default_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y)[1]


class Interleaved:
    """Run forward+backward of a tensor-parallel model over micro-batches with a schedule.

    `model` must do its TP communication through layers bound to `comm` (our
    ColumnParallelLinear / RowParallelLinear). `loss_fn(model, x, y)` returns the scalar loss
    (default: ``model(x, y)[1]``, the GPT convention). `plan` is "auto" (load the plan stored at
    `plan_path` when it matches, else profile, search and store it) or a ``Plan``.
    `max_extra_memory` bounds the plan's live activations to (1 + it) x one micro-batch's
    (None: unbounded). `measure_memory` adds ``act_peak_bytes`` to every step's timings (a
    saved-tensor hook per saved tensor; off by default, profiling measures regardless).

    Schedule "si" only: `defer_wgrad` splits the parallel layers' backward -- their weight
    gradients are queued and run in pieces while a strand would wait for a collective
    (``wgrad.py``); `wgrad_memory` caps the queue at that fraction of one micro-batch's
    activations (None: no cap); `chunks` > 1 issues each all-reduce in that many row blocks
    as its GEMM produces them (``TPComm.start_matmul``); `serial_comm` keeps one collective
    on the wire at a time, the next one queued in program order (``TPComm.serial``).
    """

    def __init__(self, model: nn.Module, comm: TPComm, schedule: str = "si",
                 loss_fn: LossFn | None = None, dp_group: dist.ProcessGroup | None = None,
                 plan: str | Plan = "auto", plan_path: Path | None = None,
                 profile_reps: int = 3, max_extra_memory: float | None = 0.05,
                 measure_memory: bool = False, defer_wgrad: bool = True,
                 wgrad_memory: float | None = 0.1, chunks: int = 1,
                 serial_comm: bool = False) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r} (choose from {', '.join(SCHEDULES)})")
        self.model = model
        self.comm = comm
        self.schedule = schedule
        self.loss_fn = loss_fn or _default_loss
        self.dp_group = dp_group
        self.dp_world = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.plan: Plan | None = plan if isinstance(plan, Plan) else None
        self.plan_path = Path(plan_path) if plan_path is not None else None
        self.plan_source = "given" if self.plan is not None else ""
        self.profile_reps = profile_reps
        self.max_extra_memory = max_extra_memory
        self._plan_shapes: list[list[int]] | None = None
        self._stream: dict[int, tuple[list[str], float]] = {}
        self.measure_memory = measure_memory
        self.meter = SavedTensorMeter(exclude=list(model.parameters()))
        # the saved-tensor hooks are on only while they are needed: profiling with a memory
        # bound, or every step when measuring
        self._track = measure_memory
        # split backward (wgrad.py) and chunked collectives (TPComm.start_matmul): "si" only,
        # the sequential and intra-micro-batch references run as before
        self.wgrad = WGradQueue() if defer_wgrad and schedule == "si" else None
        self.wgrad_memory = wgrad_memory
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1 (got {chunks})")
        self.chunks = chunks if schedule == "si" else 1
        self.serial_comm = serial_comm and schedule == "si"

    # ---- strands ------------------------------------------------------------------------
    def _tracking(self) -> contextlib.AbstractContextManager[None]:
        return self.meter.tracking() if self._track else contextlib.nullcontext()

    def _fwd_strand(self, mb: MicroBatch) -> Strand:
        x, y = mb
        return Strand("F", lambda: self.loss_fn(self.model, x, y), setup=self._tracking)

    def _bwd_strand(self, loss: torch.Tensor, scale: float = 1.0) -> Strand:
        return Strand("B", lambda: torch.autograd.backward(loss * scale),
                      setup=self._tracking)

    # ---- plan ---------------------------------------------------------------------------
    def signature(self, mb: MicroBatch, m: int, n: int) -> dict[str, Any]:
        shapes = [list(p.shape) for p in self.model.parameters()]
        return {
            "params": hashlib.sha256(repr(shapes).encode()).hexdigest()[:16],
            "micro_batch": [list(t.shape) for t in mb],
            "tp": self.comm.world,
            "world": dist.get_world_size() if dist.is_initialized() else 1,
            "segments": [m, n],
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "max_extra_memory": self.max_extra_memory,
            "defer_wgrad": self.wgrad is not None,
            "chunks": self.chunks,
            "serial_comm": self.serial_comm,
        }

    def _agree(self, plan: Plan | None) -> bool:
        """True when every TP rank holds the same plan (else all of them will re-profile)."""
        h = int(hashlib.sha256(plan.to_json().encode()).hexdigest()[:15], 16) if plan else -1
        t = torch.tensor([h, -h], dtype=torch.int64)
        if self.comm.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.comm.group)
        return plan is not None and int(t[0]) == h and int(t[1]) == -h

    def ensure_plan(self, micro_batches: Sequence[MicroBatch]) -> Plan:
        """Load a matching stored plan, or profile on these micro-batches and store one.

        Collective over the TP group. Leaves gradients dirty (the caller clears them).
        """
        mb_a, mb_b = micro_batches[0], micro_batches[-1]
        shapes = [list(t.shape) for t in mb_a]
        if self.plan is not None and self._plan_shapes == shapes:
            return self.plan
        with self._configured(filling=False):
            m, n = count_segments(lambda: self._fwd_strand(mb_a), self._bwd_strand)
            if self.wgrad is not None:
                self.wgrad.clear()
        sig = self.signature(mb_a, m, n)
        self._plan_shapes = shapes
        if self.plan is not None and self.plan.signature == sig:
            return self.plan
        stored = load_plan(self.plan_path, sig) if self.plan_path is not None else None
        self._stream.clear()
        if self._agree(stored):
            self.plan, self.plan_source = stored, "loaded"
            return stored
        mbs = iter([mb_a, mb_b] * 10_000)
        bound = self.max_extra_memory is not None
        self._track = bound or self.measure_memory
        try:
            with self._configured(filling=False):
                prof = profile_pairs(self.comm, lambda: self._fwd_strand(next(mbs)),
                                     self._bwd_strand, m, n, reps=self.profile_reps,
                                     live_bytes=(lambda: self.meter.live) if bound else None,
                                     wgrad=self.wgrad)
        finally:
            self._track = self.measure_memory
        plan = make_plan(sig, prof, self.max_extra_memory)
        self.plan, self.plan_source = plan, "profiled"
        if self.plan_path is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            save_plan(plan, self.plan_path)
        return plan

    # ---- the step -----------------------------------------------------------------------
    def _zero_grads(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def forward_backward(self, micro_batches: Sequence[MicroBatch],
                         micro_weight: float | None = None) -> tuple[float, dict[str, float]]:
        """Mean loss and {"compute_time", "comm_time", "comm_hidden", ...} in seconds.

        Gradients are overwritten (not accumulated onto old ones): the mean over the
        micro-batches, averaged over the data-parallel group. ``micro_weight`` replaces the
        1/len(micro_batches) weight of each micro-batch's loss: with a rebalancing plan
        (mitigate/rebalance.py) it is G/M on every rank, so the DP average is the mean over
        all M micro-batches of the step however they are spread.
        """
        if not micro_batches:
            raise ValueError("forward_backward needs at least one micro-batch")
        if self.schedule == "si" and len(micro_batches) > 1 and self.plan_source != "given":
            self.ensure_plan(micro_batches)
        self._zero_grads()
        led = self.comm.ledger
        led.reset()
        self.meter.reset_peak()
        scale = 1.0 / len(micro_batches) if micro_weight is None else micro_weight
        t0 = time.perf_counter()
        with self._tracking(), self._configured():
            losses = self._run(micro_batches, scale)
            if self.wgrad is not None:
                self.wgrad.flush()  # every deferred weight gradient, before anyone reads .grad
        dp_time = self._reduce_dp()
        wall = time.perf_counter() - t0
        exposed = led.exposed + dp_time
        comm_time = led.comm_time() + dp_time
        timings = {
            "compute_time": max(wall - exposed, 0.0),
            "comm_time": comm_time,
            "comm_hidden": max(comm_time - exposed, 0.0),
            "comm_exposed": exposed,
        }
        if self.measure_memory:
            timings["act_peak_bytes"] = float(self.meter.peak)
        if self.wgrad is not None:
            timings["wgrad_filled"] = self.wgrad.fill_time
            timings["wgrad_flushed"] = self.wgrad.flush_time
        return sum(losses) / len(losses), timings

    @contextlib.contextmanager
    def _configured(self, filling: bool = True) -> Iterator[None]:
        """Set the shared ``TPComm`` up for this executor's schedule for the block's duration
        (several executors may share one comm: the benchmark runs three over one model)."""
        comm, q = self.comm, self.wgrad
        comm.mode = "sync" if self.schedule == "off" else "async"
        # no completion callbacks under strands: they would stall gloo's thread on the GIL
        comm.completion_callbacks = self.schedule != "si"
        comm.chunks = self.chunks
        comm.serial = self.serial_comm
        comm.wgrad = q
        if q is not None:
            # the queue's bytes (its tasks' x and g) count against memory too: at most
            # wgrad_memory x one micro-batch's activations -- nothing, while no profile says
            # how much that is (one micro-batch, or a plan given without byte counts); while
            # profiling (not filling) it holds a whole pass, timed task by task afterwards
            unit = Profile(**self.plan.profile).unit() if self.plan is not None else 0.0
            q.max_bytes = (self.wgrad_memory * unit
                           if self.wgrad_memory is not None and filling else None)
            q.clear()
            q.reset_stats()
            q.filling = filling
            q.hold = self.meter.hold if self._track else None
        try:
            yield
        except BaseException:
            if q is not None:
                q.clear()  # a failed step's partial gradients are discarded anyway
            comm.drop_queued()
            raise
        finally:
            comm.wgrad = None
            comm.serial = False
            comm.chunks = 1
            comm.completion_callbacks = True

    def _run(self, mbs: Sequence[MicroBatch], scale: float) -> list[float]:
        if self.schedule != "si" or len(mbs) == 1:
            out = []
            for x, y in mbs:
                loss = self.loss_fn(self.model, x, y)
                (loss * scale).backward()
                out.append(loss.item())
            return out
        assert self.plan is not None
        steps = self.stream_steps(len(mbs))
        if steps is None:
            return [t.item() for t in self._run_pairs(mbs, scale)]
        # F(0) has no partner and runs alone; then one forward strand for F(1..M-1) and one
        # backward strand for B(0..M-1), each running its passes back to back
        losses: list[torch.Tensor | None] = [self.loss_fn(self.model, *mbs[0])]
        losses += [None] * (len(mbs) - 1)

        def forwards() -> None:
            for k in range(1, len(mbs)):
                if k > 1:
                    current_strand().yield_()  # a pass ends a segment (see stream_profile)
                losses[k] = self.loss_fn(self.model, *mbs[k])

        def backwards() -> None:
            for k in range(len(losses)):
                if k:
                    current_strand().yield_()
                loss = losses[k]  # read after the yield: F(k) may have finished meanwhile
                if loss is None:  # the plan search guarantees F(k) before B(k)
                    raise RuntimeError("plan started a backward before its forward")
                torch.autograd.backward(loss * scale)

        f = Strand("F", forwards, setup=self._tracking)
        b = Strand("B", backwards, setup=self._tracking)
        run_plan(steps, f, b)
        return [t.item() for t in losses]  # type: ignore[union-attr]

    def _run_pairs(self, mbs: Sequence[MicroBatch], scale: float) -> list[torch.Tensor]:
        """Pass pairs one after the other (for plans without per-segment measurements)."""
        assert self.plan is not None
        loss = self.loss_fn(self.model, *mbs[0])  # no partner: runs alone
        losses = [loss]
        for k in range(1, len(mbs)):
            f = self._fwd_strand(mbs[k])
            b = self._bwd_strand(losses[-1], scale)
            run_plan(self.plan.steps, f, b)
            losses.append(f.result)
        (losses[-1] * scale).backward()  # no partner either
        return losses

    def stream_steps(self, micro_batches: int) -> list[str] | None:
        """The whole-step plan for this many micro-batches (None: run pass pairs instead)."""
        if self.plan is None or not self.plan.profile.get("segments"):
            return None
        if micro_batches not in self._stream:
            base = Profile(**self.plan.profile)
            variants = [base]
            seg = base.segments
            if seg.get("bwd_wgrad"):
                # the same grid priced as if weight gradients ran inside their segments: the
                # DP's pairwise tables do not see the pool, so it proposes both orders and the
                # finer model (simulate_step: shared link, pool filling waits) picks
                bc = [c + w for c, w in zip(seg["bwd_compute"], seg["bwd_wgrad"], strict=True)]
                variants.append(Profile.from_segments(
                    seg["fwd_compute"], seg["fwd_comm"], bc, seg["bwd_comm"],
                    fwd_bytes=base.fwd_bytes, bwd_bytes=base.bwd_bytes))
            best: tuple[float, list[str]] | None = None
            for prof in variants:
                stream, b_ready = stream_profile(prof, micro_batches)
                steps, _ = search(stream, self.max_extra_memory, b_ready)
                t = simulate_step(seg, micro_batches, steps)
                if best is None or t < best[0]:
                    best = (t, steps)
            assert best is not None
            self._stream[micro_batches] = (best[1], best[0])
        return self._stream[micro_batches][0]

    def predicted_step_time(self, micro_batches: int) -> float | None:
        """The profile's model of one interleaved step (``plan.simulate_step``: F(0) alone,
        then the stream plan, with the link shared by both strands and the deferred
        weight-gradient pool)."""
        if self.stream_steps(micro_batches) is None:
            return None
        return self._stream[micro_batches][1]

    def _reduce_dp(self) -> float:
        if self.dp_world == 1:
            return 0.0
        t0 = time.perf_counter()
        params = [p for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.comm.await_work(dist.all_reduce(flat, group=self.dp_group, async_op=True))
        flat /= self.dp_world
        off = 0
        for p in params:
            k = p.numel()
            p.grad.copy_(flat[off:off + k].view_as(p.grad))
            off += k
        return time.perf_counter() - t0
