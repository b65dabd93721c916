"""Explicit asynchronous tensor-parallel collectives, and the accounting of their hidden part.

Mechanism (Megatron tensor parallelism, as used by DHelix): every collective of a parallel layer
is issued with ``async_op=True`` (``start``) and waited for separately (``finish``), so that
whatever runs between the two -- the layer's own weight-gradient GEMM, or the other strand's
segment in strand interleaving (DHelix, arXiv 2411.15871) -- overlaps the transfer.

``TPComm.mode`` decides what a layer may overlap:

* ``"sync"``  -- ``start`` waits at once: nothing overlaps (the sequential reference);
* ``"async"`` -- the layer overlaps its own collective with its own remaining work
  (intra-micro-batch overlap, the baseline a user would write);
* strand execution (``stalwart.overlap.strands``) additionally parks the calling strand in
  ``finish`` so that the other strand computes while the collective is in flight.

Guarantee: the numerical result never depends on the mode -- only the moment of the wait moves.

Accounting: each collective records when it was issued and when gloo completed it (a callback on
its future, run by gloo's thread), and every wait records how long the caller was blocked. Per
step, ``comm_time`` is the union of in-flight intervals, ``exposed`` the blocked time, and
``hidden = comm_time - exposed``. ``Interleaved`` resets the ledger every step; a model that
uses the layers without it never does, so the ledger bounds itself: past ``max_intervals``
completed intervals it folds the union of those that ended before the oldest collective still
in flight into one number (exact: every later interval starts after them), and if a collective
stuck in flight keeps that from shrinking the list, it folds the oldest half anyway (then a
collective in flight across the fold may lose the gaps it spanned from its length).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

MODES = ("sync", "async")
ABANDON_POLL_S = 0.05  # an interruptible wait looks for ``interrupt`` this often
# Process groups replaced by an in-place regroup, kept for the life of the process: a gloo
# group whose abandoned op is still stuck blocks in its destructor (it drains its work
# queue) until that op's timeout -- minutes -- so it must never be freed. Cost: its threads
# and sockets, per regroup.
_RETIRED: list[Any] = []


def retire(group: Any) -> None:
    """Keep ``group`` alive for good (see ``_RETIRED``)."""
    if group is not None:
        _RETIRED.append(group)
MAX_INTERVALS = 4096  # completed intervals a ledger keeps before folding (a few steps' worth)

# The strand (if any) that runs on the current thread; set by stalwart.overlap.strands.
_local = threading.local()
# The strand that holds the baton, while it runs (None while the scheduler runs): CUDA autograd
# runs a backward on its device thread, not on the strand's, and that thread must park the
# strand whose backward it is running. Only one strand runs at a time, so it is that one.
_baton: list = [None]


def current_strand():  # -> strands.Strand | None (no import: strands imports this module)
    return getattr(_local, "strand", None) or _baton[0]


def set_current_strand(strand) -> None:
    _local.strand = strand


def set_baton(strand) -> None:
    _baton[0] = strand


@dataclass
class Pending:
    """One collective in flight."""

    tensor: torch.Tensor
    work: object | None  # torch.distributed Work, None when the group has one rank
    t_issue: float
    t_done: float | None = None
    waited: bool = False
    # a chunked collective: its pieces (each recorded in the ledger on its own); t_issue is
    # the last piece's issue, t_done the last completion
    parts: list[Pending] = field(default_factory=list)
    t_wait: tuple[float, float] | None = None  # when a waiter blocked on it, and until when
    queued: bool = False  # held back by ``TPComm.serial`` until the link is free


@dataclass
class CommLedger:
    """What the collectives of one step did (times in seconds, perf_counter clock)."""

    intervals: list[tuple[float, float]] = field(default_factory=list)
    exposed: float = 0.0
    count: int = 0
    bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    max_intervals: int = MAX_INTERVALS
    folded: float = 0.0  # union length of the intervals folded away ...
    folded_end: float = -math.inf  # ... all of which ended by this time
    in_flight: dict[int, float] = field(default_factory=dict)  # id(Pending) -> issue time

    def issued(self, p: Pending) -> None:
        """A collective went in flight (call under ``lock``)."""
        self.in_flight[id(p)] = p.t_issue

    def completed(self, p: Pending, t_done: float) -> None:
        """It completed (call under ``lock``): record its interval, fold if over the bound."""
        self.in_flight.pop(id(p), None)
        self.intervals.append((p.t_issue, t_done))
        if len(self.intervals) > self.max_intervals:
            self._fold(t_done)

    @staticmethod
    def _merge(intervals: list[tuple[float, float]], start: float) -> list[list[float]]:
        """Disjoint union of the intervals, clipped to begin at `start` or later."""
        out: list[list[float]] = []
        for a, b in sorted(intervals):
            a = max(a, start)
            if b <= a:
                continue
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    def _fold(self, now: float) -> None:
        merged = self._merge(self.intervals, self.folded_end)
        cut = min(self.in_flight.values(), default=now)  # nothing later can start before
        old = [m for m in merged if m[1] <= cut]
        keep = [m for m in merged if m[1] > cut]
        if len(keep) > self.max_intervals // 2:  # a collective stuck in flight: fold anyway
            old, keep = old + keep[: -(self.max_intervals // 2)], keep[-(self.max_intervals // 2):]
        if old:
            self.folded += sum(b - a for a, b in old)
            self.folded_end = old[-1][1]
        self.intervals = [(a, b) for a, b in keep]

    def comm_time(self) -> float:
        """Length of the union of in-flight intervals (two strands' transfers may coincide)."""
        total, end = self.folded, self.folded_end
        for a, b in sorted(self.intervals):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total

    def reset(self) -> None:
        with self.lock:  # (collectives still in flight stay in in_flight: they are)
            self.intervals.clear()
            self.exposed = 0.0
            self.count = 0
            self.bytes = 0
            self.folded = 0.0
            self.folded_end = -math.inf


class TPComm:
    """The tensor-parallel group of a set of parallel layers, and how their collectives wait."""

    def __init__(self, group: dist.ProcessGroup | None, mode: str = "async") -> None:
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.mode = mode
        self.ledger = CommLedger()
        # Completion stamps from gloo's own thread (a Python callback on the work's future).
        # That callback needs the GIL, which the computing strand holds for whole ATen ops:
        # gloo's worker thread then stalls in the callback, and the collectives queued behind
        # it with it. Strand execution turns them off and stamps completion when it polls.
        self.completion_callbacks = True
        # Chunked collectives: ``start_matmul`` produces its product in this many row blocks
        # and issues each block's all-reduce as soon as it is computed (1: one piece).
        self.chunks = 1
        # Split backward: the deferred weight-gradient queue (wgrad.WGradQueue) while a
        # strand-interleaved step runs, else None (weight gradients computed at once).
        self.wgrad: Any = None
        # every collective issued, when set (bench traces; stamps completion by callback)
        self.trace: list[Pending] | None = None
        # One collective on the wire at a time (optional, Interleaved(serial_comm=True)): a
        # collective started while another is in flight is queued and issued, in program
        # order -- the same on every TP rank --, when the previous one is seen complete
        # (``pump``: at every poll, wait and parallel-layer call), so the first completes
        # sooner than when both share the link. Measured on the testbed it gained nothing
        # (0.94-1.0x): the link is saturated either way, and a queued collective waits for the
        # next pump (docs/BENCHMARKS.md, overlap).
        self.serial = False
        self._inflight: Pending | None = None
        self._queued: deque[Pending] = deque()
        # In a job that regroups in place (``interruptible``): why the collectives in flight
        # were abandoned (``interrupt``, from the membership watcher's thread), else None.
        # A gloo op on a pair its peer shut down before the op was issued can wait out the
        # group's timeout (minutes; seen when a TP partner regrouped first): waits there are
        # taken in slices that give up once a member is known lost.
        self.interruptible = False
        self.abandoned: str | None = None

    def rebind(self, group: dist.ProcessGroup | None) -> None:
        """Use ``group`` from now on (an in-place regroup rebuilt the TP group): every layer
        holding this object follows. Nothing may be in flight (between two steps)."""
        retire(self.group)
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self._inflight = None
        self._queued.clear()
        self.abandoned = None

    def interrupt(self, why: str) -> None:
        """A member of the job was lost: the collectives in flight and any issued before the
        next ``rebind`` raise RuntimeError instead of waiting (any thread may call this)."""
        self.abandoned = why

    def await_work(self, work: Any) -> None:
        """``work.wait()``; when ``interruptible``, in slices that raise once ``interrupt``
        was called. Cost there: one completion callback and event per collective."""
        if self.interruptible:
            done = threading.Event()
            work.get_future().add_done_callback(lambda _fut: done.set())
            while not done.wait(ABANDON_POLL_S):
                if self.abandoned is not None:
                    raise RuntimeError(f"tensor-parallel collective abandoned: {self.abandoned}")
        work.wait()

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in MODES:
            raise ValueError(f"unknown TPComm mode {value!r} (choose from {', '.join(MODES)})")
        self._mode = value

    # ---- the two halves of a collective -----------------------------------------------------
    def start(self, tensor: torch.Tensor) -> Pending:
        """Issue an in-place sum all-reduce of `tensor` over the TP group (with ``serial``:
        queue it while another collective is in flight)."""
        if self.mode == "sync" and tensor.is_cuda:
            # the sequential reference measures the transfer alone: without this the host,
            # ahead of the GPU, would count the kernels still producing `tensor` as
            # communication (the wait below blocks for them anyway, so nothing is lost)
            torch.cuda.synchronize(tensor.device)
        t0 = time.perf_counter()
        if self.world == 1:
            return Pending(tensor, None, t0, t0)
        p = Pending(tensor.contiguous(), None, t0)
        if self.trace is not None:
            self.trace.append(p)
        if self.serial and self.mode != "sync":
            self.pump()
            if self._inflight is not None or self._queued:
                p.queued = True
                self._queued.append(p)
                return p
        self._issue(p)
        if self.mode == "sync":
            self._wait(p)
        return p

    def _issue(self, p: Pending) -> None:
        if self.abandoned is not None:
            raise RuntimeError(f"tensor-parallel collective not issued: {self.abandoned}")
        p.t_issue = time.perf_counter()
        p.queued = False
        p.work = dist.all_reduce(p.tensor, group=self.group, async_op=True)
        led = self.ledger
        with led.lock:
            led.count += 1
            led.bytes += p.tensor.numel() * p.tensor.element_size()
            led.issued(p)
        if self.completion_callbacks or self.trace is not None:
            p.work.get_future().add_done_callback(lambda _fut, p=p: self._record_done(p))
        if self.serial:
            self._inflight = p

    def pump(self) -> None:
        """Serial mode: if the collective on the wire has completed, issue the next queued."""
        while self._inflight is not None and self._inflight.work.is_completed():
            self._record_done(self._inflight)
            self._inflight = None
            if self._queued:
                self._issue(self._queued.popleft())

    def _advance(self) -> None:
        """Block until the collective on the wire completes; issue the next queued one."""
        cur = self._inflight
        assert cur is not None, "a queued collective with nothing in flight ahead of it"
        self.await_work(cur.work)
        self._record_done(cur)
        self._inflight = None
        if self._queued:
            self._issue(self._queued.popleft())

    def drop_queued(self) -> None:
        """Forget queued and in-flight bookkeeping (after a failed step)."""
        self._queued.clear()
        self._inflight = None

    def start_matmul(self, a: torch.Tensor, b: torch.Tensor) -> Pending:
        """Issue the sum all-reduce of ``a @ b`` (a: (..., K), b: (K, N)).

        With ``chunks`` > 1 the product is computed in row blocks (rows = all of `a`'s leading
        dimensions) and each block's all-reduce is issued as soon as the block exists, so the
        transfer of one block overlaps the GEMM of the next (chunked collectives, as in async
        tensor parallelism and FLUX). Every row of the result is the same dot products, so the
        values equal the unchunked product's (up to the BLAS kernel's blocking).
        """
        k = self.chunks
        rows = a.numel() // a.shape[-1]
        if k <= 1 or self.world == 1 or rows < 2 * k:
            return self.start(torch.matmul(a, b))
        a2 = a.reshape(rows, a.shape[-1])
        out = torch.empty(rows, b.shape[-1], dtype=torch.result_type(a, b))
        bounds = [rows * i // k for i in range(k + 1)]
        parts = []
        for r0, r1 in itertools.pairwise(bounds):
            torch.matmul(a2[r0:r1], b, out=out[r0:r1])
            parts.append(self.start(out[r0:r1]))
        # t_issue: the end of the producing GEMM (what the profiler's collective time is
        # measured from: the last block's transfer, and any queued before it)
        return Pending(out.view(*a.shape[:-1], b.shape[-1]), None, time.perf_counter(),
                       parts=parts)

    def finish(self, p: Pending) -> torch.Tensor:
        """The reduced tensor. Inside a strand, first hand the baton to the other strand; when
        resumed, run deferred weight-gradient pieces while the collective is still travelling.
        """
        if not p.waited:
            strand = current_strand()
            self.pump()
            if strand is not None:
                strand.park(p)
                if self.wgrad is not None:
                    self.wgrad.fill(lambda: self.poll(p))
            self._wait(p)
        return p.tensor

    def _record_done(self, p: Pending) -> None:
        # Called by gloo's completion callback or by the waiter, whichever comes first: the
        # callback gives the true completion time when nobody waits for it yet.
        now = time.perf_counter()
        with self.ledger.lock:
            if p.t_done is None:
                p.t_done = now
                self.ledger.completed(p, now)

    def _wait(self, p: Pending) -> None:
        if p.waited:
            return
        if p.parts:
            for q in p.parts:
                self._wait(q)
            p.t_done = max(q.t_done or 0.0 for q in p.parts)
            p.waited = True
            return
        t0 = time.perf_counter()
        while p.queued:  # those ahead of it first, in order
            self._advance()
        if p.work is not None:
            self.await_work(p.work)
            self._record_done(p)
            if self._inflight is p:
                self.pump()  # p was on the wire: the next queued one goes now
        t1 = time.perf_counter()
        dt = t1 - t0
        p.t_wait = (t0, t1)
        p.waited = True
        with self.ledger.lock:
            self.ledger.exposed += dt

    def poll(self, p: Pending) -> bool:
        """Whether `p` has completed (stamping its completion time when first seen)."""
        if p.t_done is not None:
            return True
        self.pump()
        if p.parts:
            if all(self.poll(q) for q in p.parts):
                p.t_done = max(q.t_done or 0.0 for q in p.parts)
                return True
            return False
        if p.queued:
            return False
        if p.work.is_completed():
            self._record_done(p)
            return True
        return False

    def wait(self, p: Pending) -> None:
        """Block until `p` is complete (used by the profiler to put a barrier after a step)."""
        self._wait(p)

