"""Two strands -- the forward of one micro-batch and the backward of another -- run in turns.

Mechanism (DHelix strand interleaving, arXiv 2411.15871): a strand is a thread running passes
(forwards, or autograd backwards) one after another. The passes are split into *segments* at
their collectives: every ``TPComm.finish`` inside a strand issues nothing new -- it parks the
strand (its collective already in flight) and hands the baton back to the scheduler, which
resumes the other strand; a strand also yields at the end of each pass (``yield_``). So
while strand A's all-reduce travels, strand B computes, and vice versa. Only one strand
computes at a time (a baton, not free threading), so the order of every collective is fixed
by the plan and identical on all TP ranks -- gloo requires that -- and the arithmetic of each
pass is exactly the arithmetic of running it alone: one copy of the weights, the same
gradients.

The backward is driven segment by segment through autograd itself: the backward strand calls
``torch.autograd.backward`` once per pass and parks inside each column-parallel layer's
backward, at its input-gradient all-reduce. CPU autograd runs that backward on the strand's
own thread; CUDA autograd runs it on its device thread, where no strand is thread-local. So the
strand that parks is the one holding the baton (``comm.current_strand``: the thread's own
strand, else the running one): whichever thread executes a strand's pass parks it, and the
mechanism never relies on the calling thread. On CUDA both strands issue their kernels to the
same stream, in the order the baton runs them, so every pass's arithmetic and the gradients'
accumulation order are those of the sequential schedule; what overlaps a collective is the
other strand's compute while gloo's or NCCL's own streams and threads move the bytes.

Errors: a strand that raises ends its pass; ``resume`` re-raises the error on the scheduler's
thread, and ``run_plan`` then cancels the partner strand: it wakes up inside its ``park`` with
``StrandCancelled`` (chained to the first error), unwinds its pass (finally blocks run,
autograd releases its graph) and ends. So an error reaches both strands and no thread is left
parked for ever holding its activations.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from stalwart.overlap.comm import Pending, set_baton, set_current_strand


class StrandError(RuntimeError):
    pass


class StrandCancelled(StrandError):
    """Raised inside a parked strand whose partner failed (``__cause__`` is that error)."""


class Strand:
    """One pass on its own thread that runs only while the scheduler lets it (``resume``)."""

    def __init__(self, name: str, fn: Callable[[], Any],
                 setup: Callable[[], Any] | None = None) -> None:
        self.name = name
        self._fn = fn
        self._setup = setup  # context manager factory entered on the strand's thread
        self._go = threading.Semaphore(0)
        self._parked = threading.Semaphore(0)
        self._thread = threading.Thread(target=self._main, name=f"strand-{name}", daemon=True)
        self._started = False
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.pending: Pending | None = None  # the collective it parked on
        self._cancel: BaseException | None = None  # set by cancel(): raise at the next park
        self.segments = 0  # segments completed

    def _main(self) -> None:
        self._go.acquire()
        set_current_strand(self)
        try:
            if self._setup is not None:
                with self._setup():
                    self.result = self._fn()
            else:
                self.result = self._fn()
        except BaseException as e:  # surfaced by resume() on the scheduler's thread
            self.error = e
        finally:
            set_current_strand(None)
            set_baton(None)
            self.done = True
            self.pending = None
            self._parked.release()

    # ---- called on the strand's thread ----------------------------------------------------
    def yield_(self) -> None:
        """End the current segment without a collective in flight (e.g. at a pass boundary)."""
        self.park(None)

    def park(self, pending: Pending | None) -> None:
        """End the current segment with `pending` in flight; block until resumed.

        Raises ``StrandCancelled`` when the scheduler cancelled this strand (at once if it was
        already cancelled: unwinding code that parks again must not block for ever)."""
        if self._cancel is None:
            self.pending = pending
            set_baton(None)
            self._parked.release()
            self._go.acquire()
            self.pending = None
        if self._cancel is not None:
            raise StrandCancelled(f"strand {self.name} stopped: its partner strand failed "
                                  f"({self._cancel!r})") from self._cancel

    # ---- called by the scheduler ------------------------------------------------------------
    def resume(self) -> None:
        """Run the next segment: up to the next collective (or to the end of the pass)."""
        if self.done:
            raise StrandError(f"strand {self.name} has no segment left")
        if not self._started:
            self._started = True
            self._thread.start()
        set_baton(self)  # cleared by the strand before it hands the baton back
        self._go.release()
        self._parked.acquire()
        self.segments += 1
        if self.error is not None:
            raise self.error

    def cancel(self, cause: BaseException) -> None:
        """Stop this strand because of `cause` (its partner's error): a parked strand raises
        ``StrandCancelled`` in its ``park`` and unwinds; returns when its thread has ended."""
        if self.done:
            self.join()
            return
        self._cancel = cause
        if not self._started:  # never ran: nothing to unwind
            self.done = True
            self.error = StrandCancelled(f"strand {self.name} never ran: its partner failed")
            self.error.__cause__ = cause
            return
        set_baton(self)  # it unwinds through its park: on a CUDA device thread, too
        self._go.release()
        self._parked.acquire()  # released by _main's finally once the pass has unwound
        self._thread.join()

    def run_to_end(self) -> None:
        while not self.done:
            self.resume()

    def join(self) -> None:
        if self._started:
            self._thread.join()


def run_plan(plan_steps: list[str], fwd: Strand | None, bwd: Strand | None,
             barrier: Callable[[list[Strand]], None] | None = None) -> None:
    """Execute a pairing plan: each step is "F", "B" or "FB" (a pair).

    In a pair the backward segment runs first: it frees activations before the forward
    segment saves new ones, so the peak stays at the grid states the plan search bounds.

    Steps that name a finished strand are skipped; whatever remains after the plan runs alone.
    `barrier` (the profiler's) is called after each step with the strands that ran in it.
    If a strand (or the barrier) raises, the other strand is cancelled (it raises
    ``StrandCancelled`` where it is parked and unwinds) before the error propagates.
    """
    try:
        for step in plan_steps:
            ran = []
            for s, tag in ((bwd, "B"), (fwd, "F")):
                if tag in step and s is not None and not s.done:
                    s.resume()
                    ran.append(s)
            if barrier is not None and ran:
                barrier(ran)
        for s in (fwd, bwd):
            if s is not None:
                s.run_to_end()
                s.join()
    except BaseException as e:
        for s in (fwd, bwd):
            if s is not None:
                s.cancel(e)
        raise
