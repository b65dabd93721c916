"""Split backward: weight-gradient GEMMs deferred into the gaps where collectives travel.

Mechanism (DHelix's "deferred weight-gradient" units, arXiv 2411.15871; the same split as
zero-bubble pipeline schedules): a parallel linear layer's backward has two independent halves.
The input gradient ``g W`` is on the critical path -- the next layer's backward (and, for a
column-parallel layer, the all-reduce) needs it. The weight gradient ``g^T x`` is needed only by
the optimizer. With a ``WGradQueue`` attached to the layers' ``TPComm``, the layers compute the
input gradient at once and *push* the weight (and bias) gradient as a task; the task runs later,
in pieces of about ``piece_macs`` multiply-adds (row blocks of the weight gradient), whenever a
strand would otherwise block on a collective that has not completed (``fill``), and whatever is
left runs at the end of the step (``flush``). So a long transfer hides behind many short
computations instead of behind whatever the other strand happens to have.

Guarantees:

* exact gradients: tasks run first-in first-out (a task run at once because the queue is full
  first runs the queued tasks of its own weight), so every parameter receives its
  per-micro-batch gradients in the same order as autograd would accumulate them
  (``grad = 0 + g0``, then ``grad += g1`` ...); each piece computes a row block of the same
  product, so the result equals sequential execution up to the BLAS kernel's blocking
  (tests: 1e-5; usually bitwise);
* nothing is lost: ``flush`` runs every task; ``Interleaved`` flushes before the data-parallel
  reduction and clears the queue when a step fails;
* memory is accounted: while the activation meter tracks, a task keeps its ``x`` and ``g``
  counted as live (once per storage, like autograd's saved tensors) until its last piece ran.
  ``max_bytes`` bounds what the queue may hold: a task that does not fit runs at once (after
  any queued task of the same weight), the queued ones stay.

No communication happens in a task, so the moments at which tasks run may differ between TP
ranks without affecting the order of collectives.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from stalwart.overlap.comm import current_strand


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


@dataclass
class WGradTask:
    """``weight.grad += g^T x`` (and ``bias.grad += sum g``) for one layer and micro-batch."""

    x: torch.Tensor  # (tokens, in)
    g: torch.Tensor  # (tokens, out)
    weight: nn.Parameter
    bias: nn.Parameter | None
    rows: int  # weight-gradient rows per piece
    segment: int  # the backward segment that produced it (for the profiler)
    nbytes: int
    holds: list[object] = field(default_factory=list)  # meter tokens: live while held
    next_row: int = 0

    @property
    def done(self) -> bool:
        return self.next_row >= self.weight.shape[0]

    def run_piece(self) -> None:
        w = self.weight
        if self.next_row == 0:
            if w.grad is None:
                # 0 + g is exactly g: the same value autograd stores for a first gradient
                w.grad = torch.zeros_like(w)
            if self.bias is not None:
                gb = self.g.sum(0)
                if self.bias.grad is None:
                    self.bias.grad = gb
                else:
                    self.bias.grad.add_(gb)
        r0, r1 = self.next_row, min(self.next_row + self.rows, w.shape[0])
        w.grad[r0:r1].add_(self.g[:, r0:r1].t().matmul(self.x))
        self.next_row = r1
        if self.done:
            self.holds.clear()
            self.x = self.g = torch.empty(0)


class WGradQueue:
    """First-in first-out deferred weight-gradient work (see the module docstring)."""

    def __init__(self, piece_macs: float = 24e6, max_bytes: float | None = None) -> None:
        self.piece_macs = piece_macs
        self.max_bytes = max_bytes
        self.tasks: deque[WGradTask] = deque()
        self.bytes = 0
        self.filling = True  # False while profiling: tasks wait to be timed one by one
        self.hold: Callable[[torch.Tensor], object] | None = None  # the meter, when tracking
        self.fill_time = 0.0  # seconds of task work run inside waits (this step)
        self.flush_time = 0.0  # ... and at the end of the step
        self.pushed = 0  # tasks deferred (this step)

    def __len__(self) -> int:
        return len(self.tasks)

    def push(self, x: torch.Tensor, g: torch.Tensor, weight: nn.Parameter,
             bias: nn.Parameter | None) -> None:
        x, g = _flat(x).detach(), _flat(g).detach()
        rows = max(1, int(self.piece_macs // max(1, g.shape[0] * x.shape[1])))
        strand = current_strand()
        nbytes = x.numel() * x.element_size() + g.numel() * g.element_size()
        task = WGradTask(x, g, weight, bias, rows, strand.segments if strand else 0, nbytes)
        if self.hold is not None:
            task.holds = [self.hold(x), self.hold(g)]
        self.tasks.append(task)
        self.bytes += nbytes
        if self.max_bytes is not None and self.bytes > self.max_bytes:
            # it does not fit: it runs now, and what is queued stays queued (exactness needs
            # only each weight's own order, so first the queued tasks of this same weight)
            while any(t.weight is weight for t in list(self.tasks)[:-1]):
                self._run_task()
            self.tasks.pop()
            self.bytes -= nbytes
            with torch.no_grad():
                while not task.done:
                    task.run_piece()
            return
        self.pushed += 1

    def _run_piece(self) -> None:
        task = self.tasks[0]
        with torch.no_grad():
            task.run_piece()
        if task.done:
            self.tasks.popleft()
            self.bytes -= task.nbytes

    def _run_task(self) -> None:
        task = self.tasks[0]
        while not task.done:
            self._run_piece()

    def fill(self, until: Callable[[], bool]) -> None:
        """Run pieces until `until()` holds (a collective completed) or no work is left."""
        if not self.filling:
            return
        t0 = time.perf_counter()
        ran = False
        while self.tasks and not until():
            self._run_piece()
            ran = True
        if ran:
            self.fill_time += time.perf_counter() - t0

    def flush(self) -> None:
        t0 = time.perf_counter()
        while self.tasks:
            self._run_piece()
        self.flush_time += time.perf_counter() - t0

    def timed_by_segment(self, n: int, live: Callable[[], int] | None = None
                         ) -> tuple[list[float], list[float]]:
        """Run every task; per producing backward segment, the seconds spent and the bytes
        released (measured by `live`, the activation meter, when given)."""
        secs, freed = [0.0] * n, [0.0] * n
        while self.tasks:
            seg = min(self.tasks[0].segment, n - 1)
            before = live() if live is not None else 0
            device_sync()  # profiling only: a GPU task's host time is its enqueue time
            t0 = time.perf_counter()
            self._run_task()
            device_sync()
            secs[seg] += time.perf_counter() - t0
            if live is not None:
                freed[seg] += before - live()
        return secs, freed

    def clear(self) -> None:
        self.tasks.clear()
        self.bytes = 0

    def reset_stats(self) -> None:
        self.fill_time = self.flush_time = 0.0
        self.pushed = 0


def device_sync() -> None:
    """Wait for the GPU (when this process computes on one): a piece of work's host time is
    only its enqueue time otherwise. Profiling only -- timed steps never sync per segment."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
