"""The straggler Monitor: one per rank, tying sampling, exchange, decision and validation.

Pipeline (FALCON/Greyhound): the iteration-time series comes from ``monitor.step(step,
metrics)`` hints when the loop gives them, otherwise from the period of the tracked op
sequence (tracking.py, period.py) -- no call needed; rank 0's decision state machine
(decision.py) runs BOCD+V on it and on every rank's compute relative to the job's, whose
samples reach rank 0 over the exchange (exchange.py); an alarm travels back to every rank in
rank 0's row, every rank runs the validation tests (verify.LiveEvidence) at the same check,
and each computes the same verdict through the one decision path (detector.py, which replay
and the simulator drive too); rank 0 records the raw rounds in ``run_dir/validation.jsonl``
(replay re-decides on them). Rank 0 appends ``straggler_detected``,
``straggler_recovered`` and ``slowdown_unexplained`` to ``run_dir/events.jsonl`` and, at close,
its counters (hiccups, exchanges, cost) to ``run_dir/detect_stats.json``.

Guarantees: bounded memory; no change to the training loop beyond creating the monitor (the
step hint is optional); the monitor's own collectives are never tracked and are issued in the
same order on every rank (decisions and the exchange period come from rank 0 only);
iterations that contain a validation pause are excluded from detection.

Cost per step: with hints that carry compute and communication times the tracker records
nothing, and a hinted step whose check has nothing due (no row to read or send: the exchange
runs every k steps, k up to ``max_every``) only keeps its sample and returns (one C call,
``Holder``); the samples held go through the decision state machine at the next check that
has something due, in the order they came, in one ``Detector.step`` (``StepInput.held``) --
the same state as one step at a time, since the checks in between would have done nothing
-- so the analysis runs every k steps, its cost amortised over them: the held samples' and
the rows' common paths are one C call each (``DecisionCore.sample_many``,
``relative_rows``), Python runs only where a channel has more to do. An exchange is a few
~100-byte socket operations (exchange.py), one per step with ``max_every=1`` (the default:
a decision then waits for no batch).

Off the training thread: on rank 0 (the only rank with analysis to do) a check whose own row
due carries no alarm books its next row and hands the rest -- the held samples made and
joined, the other ranks' rows read, the decision path on them, rank 0's row built and sent --
to one analysis thread (``Analysis``), and returns; the next check, ``drain``, ``close`` and
every accessor of the decision state wait for it first, so the verdicts, rows and state are
those of the same work on the training thread (tests/detect/test_rel_rows.py). A check with
an alarm (validation, recovery: collectives) runs wholly on the training thread; so does
everything on the gloo fallback exchange (a collective). Rank 0's training thread then pays
the held steps and at a check the hand-over (its own row's header read, the next row booked,
the thread woken); the analysis thread's CPU (``stats()["monitor_analysis_cpu_us_median"]``
per check, ``analysis_cpu_us`` in all) is still the process's, and it holds the GIL while it
runs: a training thread that needs the GIL in that time waits up to that long. Bench
detect's ``monitor_step_cpu_us`` counts both threads per step
(``monitor_step_cpu_us_training_thread``: the training thread's alone). Measured (tests/detect/
step_cost.py, exchange every 8, rank 0 after a training step's cache-evicting work): ~15-25
us of thread CPU a held step, ~85-95 us a check, ~30-37 us a step amortised in the
one-process probe and ~43-50 us in the bench's 4-rank overhead job.

Use: create it on every rank after ``init_process_group`` and before wrapping the model in
DDP; call ``step`` on all ranks or on none. ``on_sample`` sees every iteration the monitor
counts (the seam a script run's iteration log uses), in order and never two calls at once --
on rank 0 mostly from the analysis thread.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from stalwart.detect import verify
from stalwart.detect.alarms import NONE, Alarm, IterSample
from stalwart.detect.decision import DecisionCore
from stalwart.detect.detector import VALIDATION_FILE, Detector, StepInput, StepOutput
from stalwart.detect.exchange import Exchange
from stalwart.detect.sampling import Sampler, comm_busy
from stalwart.detect.tracking import OpRecord, Tracker, install, uninstall
from stalwart.events import Event
from stalwart.rowlink import GlooRows, exchange_cost, open_rows

__all__ = ["IterSample", "Monitor", "comm_busy"]

# the run directory a Monitor() without run_dir writes to (set by `stalwart run --script`)
RUN_DIR_ENV = "STALWART_MONITOR_RUN_DIR"
STATS_FILE = "detect_stats.json"
log = logging.getLogger("stalwart.detect")


AMORTISE = 16  # steps per window of the per-step CPU figure (amortised)


class PyHolder:
    """The monitor's held steps: the Python reference of the C ``Holder``
    (detect/_native/channels.c), which runs where it is built; tests compare the two.

    ``hold(step, metrics)``: with ``on``, ``metrics`` a dict whose "step_time",
    "compute_time" and "comm_time" are present and not None, ``checks + 1 < due_at`` and
    ``n < cap``, the four objects appended, ``checks`` and ``held_steps`` counted,
    ``sampler.last_hint`` set to ``clock()``, True; else nothing changes and False.
    ``push``: append (the buffer grows when full); ``take``: the steps held, oldest first,
    the buffer emptied; ``samples(cls)``: the same as ``cls(step, float(st), float(cp),
    float(cm))`` each (emptied all the same where a time is not a number, then raised)."""

    def __init__(self, capacity: int, sampler: Any, clock: Callable[[], float]) -> None:
        if capacity < 1:
            raise ValueError("Holder: capacity >= 1")
        self.cap = capacity
        self.sampler = sampler
        self.clock = clock
        self.checks = 0
        self.due_at = 1
        self.held_steps = 0
        self.on = True
        self._buf: list[tuple[Any, Any, Any, Any]] = []

    @property
    def n(self) -> int:
        return len(self._buf)

    def hold(self, step: Any, metrics: Any) -> bool:
        if not self.on or type(metrics) is not dict or not self.checks + 1 < self.due_at or (
                len(self._buf) >= self.cap) or not held(self, step, metrics):
            return False
        self.sampler.last_hint = self.clock()
        return True

    def push(self, step: Any, st: Any, cp: Any, cm: Any) -> None:
        if len(self._buf) == self.cap:
            self.cap *= 2  # (a full buffer only sends ``hold``'s steps the longer way)
        self._buf.append((step, st, cp, cm))

    def take(self) -> list[tuple[Any, Any, Any, Any]]:
        out, self._buf = self._buf, []
        return out

    def samples(self, cls: Any) -> list[Any]:
        buf, self._buf = self._buf, []
        return [cls(k, float(st), float(cp), float(cm)) for k, st, cp, cm in buf]


try:  # the held steps in C (detect/_native/channels.c); PyHolder is the reference
    from stalwart.detect._channels import Holder as _Holder  # type: ignore[import-not-found]
except ImportError:  # no compiler at install (or an extension built before Holder)
    _Holder = PyHolder


def held(h: Any, step: Any, metrics: Any) -> bool:
    """One step held by holder ``h`` (``PyHolder`` or the C ``Holder``) from a hint's
    ``metrics`` mapping: its three times pushed and the check counted; False, nothing held,
    when one of the times is missing. Shared by ``PyHolder.hold`` and the monitor's path for
    hints that are not a dict."""
    st = metrics.get("step_time")
    cp = metrics.get("compute_time")
    cm = metrics.get("comm_time")
    if st is None or cp is None or cm is None:
        return False
    h.push(step, st, cp, cm)
    h.checks += 1
    h.held_steps += 1
    return True


def amortised(per_step: list[float], window: int = AMORTISE) -> list[float]:
    """Each full window's mean of ``per_step`` (the analysis of held samples runs at one
    step of k: a window of several periods carries it at its share); the whole list's mean
    while it is shorter than a window."""
    if len(per_step) < window:
        return [sum(per_step) / len(per_step)] if per_step else []
    return [sum(per_step[i:i + window]) / window
            for i in range(0, len(per_step) - window + 1, window)]


class Analysis:
    """One daemon thread that runs the monitor's analysis jobs one at a time, in the order
    given. The monitor gives it a job only after ``wait`` (so at most one is in flight) and
    waits again before it touches the decision state or the exchange; a job's exception is
    raised by the next ``wait``. ``cpu_us``: each job's thread CPU time, microseconds (the
    last 4096); ``cpu_total_us``: the sum over every job finished so far.
    Cost on the caller's thread: ``submit`` ~2-5 us (a lock taken and a queue put that wakes
    the thread), ``wait`` on a finished job well under 1 us (C calls only: the busy flag is
    a lock the job holds, not a ``threading.Event``, whose Python methods cost a few us each
    on caches a training step has evicted)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # held from ``submit`` until the job is done (released by the analysis thread)
        self._busy = threading.Lock()
        self._error: BaseException | None = None
        self.cpu_us: deque[float] = deque(maxlen=4096)
        self.cpu_total_us = 0.0  # (written by the thread only, before its job counts as done)
        self._thread = threading.Thread(target=self._run, name="stalwart-monitor-analysis",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._busy.acquire()
        self._q.put(job)

    def wait(self) -> None:
        busy = self._busy
        if busy.locked():
            busy.acquire()
            busy.release()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        """The job in flight finished (its exception raised), the thread ended."""
        try:
            self.wait()
        finally:
            self._q.put(None)
            self._thread.join()

    def _run(self) -> None:
        clock = time.thread_time
        while True:
            job = self._q.get()
            if job is None:
                return
            c0 = clock()
            try:
                job()
            except BaseException as e:  # raised on the monitor's thread by ``wait``
                self._error = e
            finally:
                us = 1e6 * (clock() - c0)
                self.cpu_us.append(us)
                self.cpu_total_us += us
                job = None  # (an idle thread keeps no monitor alive)
                self._busy.release()


class Monitor:
    """Straggler detection for one rank. See the module docstring and docs/detect.md."""

    def __init__(self, run_dir: Path | None = None, rank: int | None = None,
                 world: int | None = None, track_ddp: bool = True, *, warmup: int = 10,
                 check_every: int | None = None, validate_on_detect: bool = True,
                 compute_reps: int = 64, link_bytes: int = 1 << 18,
                 capacity: int = 8192, history: int = 1000, lag: int = 1,
                 max_every: int = 1, persist: int = 20, device: Any = None,
                 on_sample: Callable[[IterSample], None] | None = None,
                 hinted: bool = False, analysis_thread: bool = True,
                 skip_links: set[tuple[int, int]] | None = None) -> None:
        """``check_every``: steps per exchange (None: chosen by rank 0 between 1 and
        ``max_every``, exchange.py); a fixed period reads each row ``lag`` exchanges later --
        what ``--comm lossy`` jobs use (8 and 2), because the monitor's TCP exchanges stall on
        retransmission timeouts under packet loss while training does not. ``persist``:
        samples an unexplained slowdown must last to be logged (decision.py). ``device``: the
        job's compute device when the caller knows it (``stalwart run`` passes it; ranks that
        share GPUs over gloo compute on CUDA although their backend says gloo), else found
        from the default group's backend (verify.py). ``hinted``: the caller hints every step
        from the first (``step``), so tracked ops never make samples -- a monitor made again
        mid-run (an in-place regroup) would otherwise sample its first step from the ops and
        check (and validate) inside it. ``analysis_thread``: rank 0 analyses a check's
        samples and rows and sends its row on a thread of its own (``_check``); False: on
        the calling thread. ``skip_links``: rank pairs the validation tests leave out
        (known slow and taken off the ring, verify.py), the same on every rank."""
        if run_dir is None and os.environ.get(RUN_DIR_ENV):
            run_dir = Path(os.environ[RUN_DIR_ENV])  # a script's own Monitor() in a run
        ready = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (
            dist.get_rank() if ready else int(os.environ.get("RANK", "0")))
        self.world = world if world is not None else (
            dist.get_world_size() if ready else int(os.environ.get("WORLD_SIZE", "1")))
        if lag < 1 or (check_every is not None and check_every < 1) or max_every < 1:
            raise ValueError(f"need lag, check_every, max_every >= 1: {lag}, {check_every}, "
                             f"{max_every}")
        self.check_every = 1 if check_every is None else check_every
        self.device = device
        self.validate_on_detect = validate_on_detect
        self.compute_reps = compute_reps
        self.link_bytes = link_bytes
        self.on_sample = on_sample
        self.tracker = Tracker(capacity, on_issue=self._on_issue)
        self.tracker.track_ddp = track_ddp  # read by the DDP patch
        self.sampler = Sampler(self.tracker)
        self.periods = self.sampler.periods
        self._run_dir = Path(run_dir) if run_dir is not None else None
        self._events = None
        if self._run_dir is not None and self.rank == 0:
            from stalwart.rundir import EventLog

            self._events = EventLog(self._run_dir)
        self._core = DecisionCore(self.rank == 0, warmup=warmup, persist=persist,
                                 history=history, emit=self._emit)
        self._pg: Any = None
        self._threaded = analysis_thread
        self._analysis: Analysis | None = None  # rank 0's analysis thread, made at first use
        self.exchange: Exchange | None = None
        if ready and self.world > 1:
            # made here, not at the first exchange: every rank constructs the monitor at the
            # same point, before training (made mid-training under 10% packet loss, the
            # group's connection setup left ranks 0.6-4.8 s apart)
            every = max_every if check_every is None else check_every
            with self.tracker.internal():
                rows = open_rows(self.rank, self.world, Exchange.width(every), self.group())
            cost = exchange_cost(rows, Exchange.width(every)) if check_every is None else 0.0
            self.exchange = Exchange(self.rank, rows, self._core, check_every=check_every,
                                     max_every=max_every, lag=lag, process_cost=cost)
        # the validation tests behind the one decision path (detector.py): live collectives
        self.source = verify.LiveEvidence(
            self.group, self.world, self.rank, compute_reps=compute_reps,
            link_bytes=link_bytes, device=device,
            enabled=self.exchange is not None and validate_on_detect, skip_links=skip_links)
        self.detector = Detector(self._core, self.source, self.rank)
        self._rounds_log: Any = None  # rank 0: the raw validation rounds (replay re-decides)
        if self._run_dir is not None and self.rank == 0:
            from stalwart.rundir import JsonlWriter

            self._rounds_log = JsonlWriter(self._run_dir / VALIDATION_FILE)
        self._hinted = hinted
        self._last_key: int | None = None
        self._next_check = self.check_every  # without an exchange (one process)
        self._skip_next = False
        self._paused = False  # this step held a validation pause (not step time)
        self._enabled = True
        self._closed = False
        self._check_cpu_us: deque[float] = deque(maxlen=4096)  # CPU of steps with a check
        # hinted steps waiting for a check with work: (step, step, compute, comm time) in a
        # buffer made once (a period's worth; it grows only if a period outgrows it), with
        # the check count, the next check with work (a row to read or send) and the count
        # of steps that only recorded (``step``'s first test, in C where built)
        self._holder: Any = _Holder(2 * max(max_every, self.check_every) + 2, self.sampler,
                                    time.perf_counter)
        install(self.tracker)

    # ---- what the decision state machine holds ----------------------------------------------
    @property
    def core(self) -> DecisionCore:
        """The decision state machine, once the analysis in flight (if any) is done."""
        self._wait()
        return self._core

    @property
    def findings(self) -> list[Any]:
        return self.core.findings

    def request_recovery_test(self, step: int) -> bool:
        """Rank 0: a compute test of the followed straggler at ``step``, for the work plan
        (``DecisionCore.request_recovery_test``: False when not taken). Waits for the
        analysis in flight, if any."""
        return self.core.request_recovery_test(step)

    @property
    def samples(self) -> Any:
        self._flush()
        return self._core.samples

    @property
    def hiccups(self) -> int:
        return self.core.hiccups

    def _wait(self) -> None:
        """The analysis thread's job in flight finished (its exception raised here)."""
        if self._analysis is not None:
            self._analysis.wait()

    @property
    def analysis_cpu_us(self) -> float:
        """The analysis thread's CPU time over every job it has finished, microseconds (0
        without the thread); a job in flight is not counted until it is done. Does not
        wait for it: a caller measuring per-step cost reads it after ``drain``."""
        return self._analysis.cpu_total_us if self._analysis is not None else 0.0

    # ---- the held steps' counters (``_holder``) -----------------------------------------------
    @property
    def _checks(self) -> int:
        return int(self._holder.checks)

    @_checks.setter
    def _checks(self, v: int) -> None:
        self._holder.checks = v

    @property
    def _due_at(self) -> int:
        return int(self._holder.due_at)

    @_due_at.setter
    def _due_at(self, v: int) -> None:
        self._holder.due_at = v

    @property
    def _n_held(self) -> int:
        return int(self._holder.n)

    # ---- switches ---------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Turn tracking and checks off/on (all ranks at the same point, e.g. the same step)."""
        self._enabled = on
        self._holder.on = on and not self._closed
        self.tracker.enabled = on
        self.sampler.last_hint = None

    def drain(self) -> None:
        """Wait until the exchanges in flight are complete (they stay queued and are read at
        their check as usual). Called at the same step on every rank; lets a caller that
        turns the monitor off charge their cost to the steps that issued them."""
        a = self._analysis  # (``_wait``: a row the analysis thread sends is in flight once
        if a is not None:  # it is done)
            a.wait()
        if self.exchange is not None:
            self.exchange.drain()

    # ---- sampling ---------------------------------------------------------------------------
    def step(self, step: int, metrics: dict[str, Any] | None = None) -> None:
        """Optional hint at the end of each training step (call on all ranks or none).

        A step whose check has nothing due and whose hint carries its step, compute and
        communication times only records them in the held buffer and returns (no sample is
        built, no clock but the hint's is read); the analysis runs at the next check with
        work, on every step held (``_flush``)."""
        if self._holder.hold(step, metrics):
            return
        if metrics is not None and type(metrics) is not dict and self._hold_mapping(
                step, metrics):
            return
        if not self._enabled or self._closed:
            return
        c0 = time.thread_time()
        self._wait()  # the last check's analysis (it feeds the exchange that ``_due`` reads)
        self._hinted = True
        s = self.sampler.from_hint(step, metrics)
        if s is None:
            return
        h = self._holder
        c1 = h.checks + 1
        if not self._due(c1):
            h.push(s.key, s.seconds, s.compute, s.comm)
            h.checks = c1  # a check with nothing due: the sample waits for the next one
            return
        paused = self._core.verdicts
        self._paused = False
        self._check(s, self._take_held())
        if self._core.verdicts != paused or self._paused:
            self.sampler.last_hint = time.perf_counter()  # a validation pause is not step time
        else:
            self._check_cpu_us.append(1e6 * (time.thread_time() - c0))

    def _hold_mapping(self, step: int, metrics: Any) -> bool:
        """``Holder.hold`` for hints that are not a dict (any mapping with ``get``)."""
        h = self._holder
        if not (self._enabled and not self._closed and h.checks + 1 < h.due_at
                and h.n < h.cap) or not held(h, step, metrics):
            return False
        self.sampler.last_hint = time.perf_counter()
        return True

    def _on_issue(self, rec: OpRecord) -> None:
        """Every tracked op, before it is issued: find iterations without hints."""
        if self._hinted or not self._enabled:
            return
        s = self.sampler.from_op(rec)
        if s is not None:
            self._check(s)

    def _due(self, c: int) -> bool:
        """Whether check ``c`` has anything to do (a row to read or to send)."""
        if self.exchange is None:
            return c >= self._next_check
        return self.exchange.due(c)

    def _flush(self) -> None:
        """The held samples into the decision path, each as its own step would have (a step
        with no row to read or send)."""
        self._wait()
        held = self._join_held(self._take_held())
        if held:
            self.detector.step(StepInput(held=held, issue=False))

    def _take_held(self) -> list[IterSample]:
        """The held steps as samples (``Holder.samples``: one C call where built), admitted
        (``_admit``: the first one goes if it held a validation pause), oldest first, the
        buffer emptied; ``_join_held`` joins them to the row."""
        raw = self._holder.samples(IterSample)
        if raw and self._skip_next:
            self._skip_next = False
            raw = raw[1:]
        return raw

    def _join_held(self, held: list[IterSample]) -> list[IterSample]:
        """``_take_held``'s samples, in order, each joined to this rank's next row and shown
        to ``on_sample`` (``_joined``): the caller passes them to the decision path
        (``StepInput.held``) next."""
        hook, ex = self.on_sample, self.exchange
        if hook is not None:
            for s1 in held:
                self._joined(s1)
            return held
        # ``_joined`` for each, inline (no hook): the samples with a compute time and a new
        # key join the row, in order
        last, new = self._last_key, []
        for s1 in held:
            if s1.compute and s1.key != last:
                last = s1.key
                new.append((float(last), s1.compute))  # (``Exchange.add``'s floats)
        self._last_key = last
        if ex is not None and new:
            ex.add_floats(new)
        return held

    def _admit(self, s: IterSample) -> IterSample | None:
        """The sample, or None for the one iteration that held a validation pause (found
        from the op sequence: not step time)."""
        if self._skip_next:
            self._skip_next = False
            return None
        return s

    def _sampled(self, s: IterSample) -> None:
        """After a sample went in: it joins this rank's next row; the caller's hook."""
        self._note_last()
        if self.on_sample is not None:
            self.on_sample(s)

    def _joined(self, s: IterSample) -> None:
        """A held sample joins this rank's next row (as ``_note_last`` once it is the
        decision path's newest, which it will be: ``DecisionCore`` appends each sample it
        takes); the caller's hook."""
        if s.compute and s.key != self._last_key:
            self._last_key = s.key
            if self.exchange is not None:
                self.exchange.add(s.key, s.compute)
        if self.on_sample is not None:
            self.on_sample(s)

    # ---- checks -----------------------------------------------------------------------------
    def _check(self, s: IterSample, raw: list[IterSample] | None = None) -> None:
        """Collective: one ``Detector.step`` -- the samples held since the last check
        (``raw``, from ``_take_held``), this iteration's sample, the rows due now, this
        rank's row sent, and an alarm they carry validated and applied by every rank
        together (exchange.py is the transport).

        On rank 0 with the socket exchange, a check whose own row due carries no alarm
        (``Exchange.read_own``) books its next row (``Exchange.reserve``) and hands the rest
        -- the held samples made and joined, the other ranks' rows read, the decision path
        on them, the row's content and its send -- to the analysis thread (``Analysis``) and
        returns: no collective runs there, nothing but that thread touches the decision
        state or the exchange until the next ``_wait`` (every check, and every accessor,
        waits first), and the same steps run in the same order on the same inputs, so the
        state, the rows and the verdicts are those of the same work done here. A check with
        an alarm runs here, its tests' collectives in the same order on every rank."""
        self._wait()
        h = self._holder
        c = h.checks + 1
        h.checks = c
        ex = self.exchange
        if (ex is not None and self._threaded and self._core.leader
                and not isinstance(ex.rows, GlooRows)):
            head = ex.read_own(c)
            if head is None or head[1].action == NONE:
                self._analyse(c, self._admit(s), head, raw or [])
                return
            held = self._join_held(raw or [])
            s1 = self._admit(s)
            rows, alarm = ex.read_rows(head[0]), head[1]
            self._decide(c, s1, rows, alarm, ex.issues(c), held)
            return
        held = self._join_held(raw or [])
        s1 = self._admit(s)
        rows: list[tuple[int, list[float]]] = []
        alarm: Alarm | None = None
        if ex is None:
            issue = c >= self._next_check
            if issue:
                self._next_check = c + self.check_every
        else:
            rows, alarm = ex.read(c)
            issue = ex.issues(c)
        self._decide(c, s1, rows, alarm, issue, held)

    def _decide(self, c: int, s1: IterSample | None, rows: list[tuple[int, list[float]]],
                alarm: Alarm | None, issue: bool, held: list[IterSample]) -> None:
        """``_check``'s decision step on this thread."""
        ex = self.exchange

        def send(a: Alarm) -> None:  # this check's row leaves before the verdict's tests
            if s1 is not None:
                self._sampled(s1)
            if ex is not None:
                ex.issue(c, a)

        inp = StepInput(sample=s1, rows=rows, alarm=alarm, issue=issue, send=send,
                        held=held)
        if alarm is not None and alarm.action != NONE:
            with self.tracker.internal():  # the validation tests' collectives: not training's
                out = self.detector.step(inp)
        else:
            out = self.detector.step(inp)
        if not issue and s1 is not None:
            self._sampled(s1)
        self._after(out)
        if ex is None and out.send.action != NONE:
            # one process: the alarm is read back at once (no row to travel)
            with self.tracker.internal():
                self._after(self.detector.step(StepInput(alarm=out.send, issue=False)))
        self._set_due()

    def _analyse(self, c: int, s1: IterSample | None, head: tuple[int, Alarm] | None,
                 raw: list[IterSample]) -> None:
        """``_check`` for a check that validates nothing, on the analysis thread: this
        thread only books the next row (the schedule ``_set_due`` reads). ``head``: the row
        due now (``Exchange.read_own``), whose other ranks' rows the job reads."""
        ex = self.exchange
        assert ex is not None
        issue = ex.issues(c)
        seq = ex.reserve(c) if issue else -1
        alarm = None if head is None else head[1]

        def send(a: Alarm) -> None:
            if s1 is not None:
                self._sampled(s1)
            ex.send(c, seq, a)

        def job() -> None:
            held = self._join_held(raw)
            rows = [] if head is None else ex.read_rows(head[0])
            out = self.detector.step(StepInput(sample=s1, rows=rows, alarm=alarm, issue=issue,
                                               send=send, held=held))
            if not issue and s1 is not None:
                self._sampled(s1)
            self._after(out)  # (no validation ran: nothing paused, nothing to record)

        if self._analysis is None:
            self._analysis = Analysis()
        self._analysis.submit(job)
        self._set_due()

    def _set_due(self) -> None:
        """The next check with work (a held step before it only records)."""
        ex = self.exchange
        self._due_at = self._next_check if ex is None else ex.next_due()

    def _after(self, out: StepOutput) -> None:
        if out.paused:
            self._skip_next = not self._hinted  # this iteration holds the pause
            self._paused = True
        self._record(out)

    def _note_last(self) -> None:
        """The newest sample joins this rank's next row (once)."""
        last = self._core.samples[-1] if self._core.samples else None
        if last is not None and last.compute and last.key != self._last_key:
            self._last_key = last.key  # a skipped sample leaves the last one in place
            if self.exchange is not None:
                self.exchange.add(last.key, last.compute)

    def _record(self, out: StepOutput) -> None:
        """Rank 0: the raw validation rounds and recovery tests, one JSON line each, so that
        replay runs the rules on them again (``stalwart replay``); a few kB per validation."""
        if self._rounds_log is None:
            return
        rec = out.validation.record() if out.validation is not None else (
            out.recovery if out.paused else None)
        if rec is not None:
            try:
                self._rounds_log.write(rec)
            except OSError as e:  # a record is for replay, never a failure of the job
                log.debug("could not write %s: %s", VALIDATION_FILE, e)

    def group(self) -> Any:
        """The monitor's own gloo group: its traffic never queues behind training's."""
        if self._pg is None:
            # collective: every rank constructs its monitor at the same point
            self._pg = dist.new_group(backend="gloo")
        return self._pg

    def _emit(self, ev: Event) -> None:
        if self._events is not None:
            self._events.emit(ev)

    # ---- outputs ----------------------------------------------------------------------------
    def report(self) -> list[dict[str, Any]]:
        """Findings so far (every rank has the same verdicts), oldest first."""
        return [{**f.event_fields(), "recovered_step": f.recovered_step}
                for f in self.core.findings]

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._flush()  # (no check: what a step would have sampled, without its exchange)
        finally:
            if self._analysis is not None:
                self._analysis.close()
        self._closed = True
        self._holder.on = False
        if self.exchange is not None:
            self.exchange.close()
        uninstall(self.tracker)
        self._core.close()
        if self.rank == 0 and self._run_dir is not None:
            try:
                (self._run_dir / STATS_FILE).write_text(json.dumps(self.stats(), indent=1))
            except OSError as e:  # statistics are a convenience, never a failure
                log.debug("could not write %s: %s", STATS_FILE, e)
        if self._events is not None:
            self._events.close()
        if self._rounds_log is not None:
            self._rounds_log.close()

    def stats(self) -> dict[str, Any]:
        """The monitor's counters: hiccups, logged unexplained slowdowns, exchanges, cost."""
        cpu = sorted(self._check_cpu_us)
        core = self.core
        job = sorted(self._analysis.cpu_us) if self._analysis is not None else []
        ex = self.exchange.stats() if self.exchange is not None else {
            "exchanges": 0, "check_every": self.check_every}
        return {"hiccups": core.hiccups, "unexplained_logged": core.unexplained_logged,
                "repeat_verdicts": core.repeats, "hiccup_log": list(core.hiccup_log),
                "findings": len(core.findings), "checks": self._checks, **ex,
                "audit": core.audit,
                "outlier_alarms": core.outliers.alarms if core.outliers is not None else 0,
                # rank 0's thread CPU of the steps with a check (reading the rows due; the
                # analysis of the samples held since and the row's send where no analysis
                # thread took them); the held steps, which only record, are not timed (a
                # clock read would cost more than they do): bench detect's overhead job
                # measures the amortised per-step figure from outside
                "monitor_check_cpu_us_median": round(cpu[len(cpu) // 2], 1) if cpu else None,
                # the analysis thread's CPU per check it took (``_check``): process CPU the
                # training thread does not pay, but the job does
                "monitor_analysis_cpu_us_median": round(job[len(job) // 2], 1) if job else None,
                "analysed_off_thread": len(job),
                "held_steps": int(self._holder.held_steps)}

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
