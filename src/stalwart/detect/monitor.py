"""The straggler Monitor: tracking -> iteration time -> change points -> validation -> verdict.

Ties FALCON/Greyhound's detection pipeline together inside one training process (one Monitor
per rank):
1. ``Tracker`` records every collective and DDP bucket all-reduce (tracking.py);
2. the iteration-time series comes from ``monitor.step(step, metrics)`` hints when the loop
   gives them, otherwise from the op sequence's period (period.py) -- no call needed;
3. rank 0 runs BOCD+V on it (changepoint.py), and on per-rank channels: each rank's compute
   time relative to the job's median (NVIDIA-style relative score). Every rank sends its
   compute times in a small row (rank 0's decision, the samples since the last exchange) over
   the monitor's row link (rowlink.py: a TCP connection to rank 0; rank 0's row goes back to
   every rank), read one check point later (each step hint, or each iteration boundary found
   from the op sequence), so all ranks pause at the same collective boundary without ever
   blocking on it;
4. on a detected onset every rank runs the validation tests (validate.py) and shares its
   profile and test times; each rank computes the same verdict (localize.py); rank 0 appends
   it to ``run_dir/events.jsonl`` as ``straggler_detected`` and, when the channel that found
   it returns to within 10% of its healthy level, ``straggler_recovered``.

Cost (per step, rank 0 does the most): with step hints that carry compute and communication
times the tracker records nothing (its records would only re-derive those times); a change
detector's model sleeps while no change could be verified (changepoint.py's pre-filter), so a
quiet channel costs a few scalar operations; the per-rank channels that are awake advance in
one vector BOCPD update (changepoint.BOCPDBank). The exchange is a few ~100-byte socket
sends and receives on the calling thread (a gloo all-gather of the same row cost ~0.85 ms of
process CPU per rank, in gloo's threads: rowlink.py); its process CPU is measured once at
construction. With ``check_every=None`` (the default) rows are exchanged every k steps, k
chosen by rank 0 so that the exchange costs at most ``EXCHANGE_BUDGET`` (0.2%) of the
process's CPU time per step, capped at ``max_every``, and back to 1 while a change
detector's posterior has fired, a decision is on its way, or any other rank's own compute
time jumped (a cheap pre-filter on each rank, folded into rank 0's next choice); rank 0's row
carries the period, so all switch at the same check. The cap is a latency trade: a rank's
compute samples can reach rank 0 up to k-1 steps later. The default ``max_every=1`` keeps one
exchange per step (what the benchmark measured over the row link; the budget alone would
pick k = 2 on the tiny preset, ~0.15 ms per exchange against 0.2% of ~40 ms).

Silence on clean runs: a verified slowdown that validation pins on no rank or link (kind
"unknown": the job as a whole slowed, or a fault already gone) is not logged at once. If the
iteration time is still ``min_shift`` above its healthy level ``persist`` samples later, rank 0
logs ``slowdown_unexplained``; otherwise it was an OS hiccup of a few steps that nothing
confirmed: it is counted in ``monitor.hiccups`` and the debug log, and written with the
monitor's other counters to ``run_dir/detect_stats.json`` at close -- never to events.

Guarantees: bounded memory; no change to the training loop beyond creating the monitor (the
step hint is optional); the monitor's own collectives are never tracked and are issued in
the same order on every rank (decisions and the exchange period come from rank 0 only);
iterations that contain a validation pause are excluded from detection.

Use: create it on every rank after ``init_process_group`` and before wrapping the model in
DDP; call ``step`` on all ranks or on none.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stalwart.detect import validate
from stalwart.detect.changepoint import BOCPDBank, Change, ChangeDetector, rank_sum_z
from stalwart.detect.cusum import REF_RANKS, CusumBank, per_rank_z
from stalwart.detect.localize import (
    BEFORE,
    ONSET_SLACK,
    Finding,
    RankEvidence,
    decide,
    more_rounds,
)
from stalwart.detect.period import PeriodTracker
from stalwart.detect.rowlink import GlooRows, StarRows, exchange_cost
from stalwart.detect.tracking import OpRecord, Tracker, install, uninstall
from stalwart.hostaddr import default_host

NONE, DETECT, RECOVER = 0, 1, 2
HEADER = 6  # row: action, onset, severity, suspect rank, entries, next exchange period
# the run directory a Monitor() without run_dir writes to (set by `stalwart run --script`)
RUN_DIR_ENV = "STALWART_MONITOR_RUN_DIR"
EXCHANGE_BUDGET = 0.002  # the exchange may cost this fraction of a step's CPU time
ALERT_CHECKS = 4  # exchange every step this long after a change detector fired
LASTING_Z = 3.0  # an unexplained slowdown is logged only if it lasts beyond chance (p ~ 1e-3)
ALERT_JUMP = 0.25  # a rank's compute this much above its recent median, twice, asks k = 1
STATS_FILE = "detect_stats.json"
POOLED_FLOOR = 0.75  # a per-rank channel's noise scale is at least this x the pooled one
LINK_SETUP_S = 30.0  # seconds to set up the row link before falling back to the all-gather
READ_TIMEOUT_S = 1800.0  # a due row this late means a peer is gone: raise, never hang
log = logging.getLogger("stalwart.detect")


def _suspect(channel: str) -> int:
    """The rank a per-rank channel ("rank3") points at; -1 for the iteration-time channel."""
    return int(channel[4:]) if channel.startswith("rank") else -1


MIN_PERIOD_NUMEL = 1024  # FALCON skips tiny ops (control traffic: losses, flags, barriers)


@dataclass
class IterSample:
    key: int  # step (hinted) or iteration index (from the op sequence)
    seconds: float
    compute: float | None
    comm: float | None


def comm_busy(records: list[OpRecord], t0: float, t1: float) -> float:
    """Seconds within [t0, t1] during which at least one tracked op was in flight."""
    spans = []
    for r in records:
        end = r.finish()
        a, b = max(r.issue, t0), min(end if end is not None else r.issue, t1)
        if b > a:
            spans.append((a, b))
    spans.sort()
    busy, cur_a, cur_b = 0.0, None, None
    for a, b in spans:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        busy += cur_b - cur_a
    return busy


class Monitor:
    """Straggler detection for one rank. See the module docstring and docs/detect.md."""

    def __init__(self, run_dir: Path | None = None, rank: int | None = None,
                 world: int | None = None, track_ddp: bool = True, *, warmup: int = 10,
                 check_every: int | None = None, validate_on_detect: bool = True,
                 compute_reps: int = 64, link_bytes: int = 1 << 18,
                 capacity: int = 8192, history: int = 1000, lag: int = 1,
                 max_every: int = 1, persist: int = 20, device: Any = None) -> None:
        """``check_every``: steps per exchange of rows (each exchange carries every step's
        samples, so nothing is dropped); None (default) lets rank 0 choose it from measured
        costs, between 1 and ``max_every``, each row read at the next check. A fixed
        ``check_every`` reads each row ``lag`` exchanges later: under packet loss the
        monitor's small exchanges (TCP) stall on TCP retransmission timeouts (>= 200 ms
        each, one after the other on its connection) while training itself does not
        (``--comm lossy``): one exchange per step would hold every rank to the group's
        ~4 ops/s and skew the ranks against the lossy transport's phase deadlines, so such
        jobs exchange every 8 steps with 2 exchanges in flight. ``persist``: samples an
        unexplained slowdown must last to be logged (see the module docstring). ``device``:
        the job's compute device when the caller knows it (``stalwart run`` passes it: ranks
        that share GPUs over gloo compute on CUDA although their backend string says gloo);
        None: found from the default group's backend (``validate.validation_device``)."""
        if run_dir is None and os.environ.get(RUN_DIR_ENV):
            # under `stalwart run --script`: a script's own Monitor() writes into the run
            run_dir = Path(os.environ[RUN_DIR_ENV])
        ready = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (
            dist.get_rank() if ready else int(os.environ.get("RANK", "0")))
        self.world = world if world is not None else (
            dist.get_world_size() if ready else int(os.environ.get("WORLD_SIZE", "1")))
        if lag < 1 or (check_every is not None and check_every < 1) or max_every < 1:
            raise ValueError(f"need lag, check_every, max_every >= 1: {lag}, {check_every}, "
                             f"{max_every}")
        self.auto_every = check_every is None
        self.check_every = 1 if check_every is None else check_every  # in force now
        self.max_every = max_every if check_every is None else check_every
        self.persist = persist
        self.device = torch.device(device) if device is not None else None
        self.validate_on_detect = validate_on_detect
        self.compute_reps = compute_reps
        self.link_bytes = link_bytes
        self.tracker = Tracker(capacity, on_issue=self._on_issue)
        self.tracker.track_ddp = track_ddp  # read by the DDP patch
        self.periods = PeriodTracker()
        self.detector = ChangeDetector(warmup=warmup)
        # per-rank compute channels (rank 0): each rank's compute / the job's median, per step
        self.rel_detectors: dict[int, ChangeDetector] = {}
        self.cusum: CusumBank | None = None  # the same channels, for small lasting shifts
        # rank 0, more than REF_RANKS ranks: recent cross-rank spreads of log relative compute
        # and the noise floor set from them on every per-rank channel (``_pool_noise``)
        self._spreads: deque[float] = deque(maxlen=32)
        self._floor: float | None = None
        self._own_floors = (0.0, 0.0)
        self._channel = "iteration"  # which channel found the slowdown in progress
        self.samples: deque[IterSample] = deque(maxlen=history)
        self.findings: list[Finding] = []
        self._active: Finding | None = None  # the slowdown in progress, if any
        self._healthy: float | None = None  # iteration time before it began
        # rank 0: (channel, level before) of a second straggler awaiting its verdict
        self._switch_to: tuple[str, float] | None = None
        # rank 0's decision, sent at the next check: (action, onset, severity, suspect rank)
        self._pending: tuple[int, int, float, int] = (NONE, 0, 0.0, -1)
        self.lag = lag
        self._deciding = 0  # rank 0: rows in flight that carry a decision
        self._repeats = 0  # verdicts that named the active straggler again (not logged)
        self._unsent: list[tuple[float, float]] = []  # (step, compute) since the last exchange
        self._last_key: int | None = None
        # the exchanges in flight, oldest first: (sequence number, check at which it is
        # read); every rank issues and reads them at the same checks
        self._inflight: deque[tuple[int, int]] = deque()
        self._rows: StarRows | GlooRows | None = None
        self._requested = self.max_every  # rank 0: the least period the last rows asked
        self._next_issue = self.check_every  # check number of the next exchange
        self._last_issue = 0
        self._alert_until = 0  # rank 0: exchange every step until this check
        # rank 0's measurements for the exchange period: CPU seconds per exchange -- this
        # thread's (pack, issue, wait, unpack), measured every exchange, and the whole
        # process's (the backend's threads and the kernel too), measured once at start --
        # and process CPU seconds per check
        self._exchange_cpu: float | None = None
        self._exchange_process_cpu = 0.0
        self._cpu_at_check: float | None = None
        self._step_cpu: deque[float] = deque(maxlen=32)
        self._exchange_costs: deque[float] = deque(maxlen=16)
        self._own_compute: deque[float] = deque(maxlen=16)  # for _request_every
        self._own_high = False
        self.exchanges = 0
        # silence on clean runs (rank 0): an unexplained slowdown waiting to prove it lasts
        # (event fields, healthy level, decision key)
        self._unexplained: tuple[dict[str, Any], list[float], int] | None = None
        self.hiccups = 0
        # the last hiccups' evidence (rank 0), for detect_stats.json: why a change was let go
        self.hiccup_log: deque[dict[str, Any]] = deque(maxlen=16)
        self.unexplained_logged = 0
        self._step_cpu_us: deque[float] = deque(maxlen=4096)  # CPU inside step() (rank 0)
        self._run_dir = Path(run_dir) if run_dir is not None else None
        self._pg: Any = None
        if dist.is_available() and dist.is_initialized() and self.world > 1:
            # made here, not at the first exchange: every rank constructs the monitor at the
            # same point of the script, before training; made lazily at step 8, its gloo
            # connection setup ran under the job's 10% packet loss (SYN retransmissions after
            # 1 s, then 3 s) and ranks left it 0.6-4.8 s apart, mid-training
            self._group()
            self._rows = self._link()
            if self.auto_every:
                self._exchange_process_cpu = exchange_cost(self._rows, self._width())
        self._hinted = False
        self._last_hint: float | None = None
        self._iter = 0
        self._checks = 0
        self._skip_next = False
        self._enabled = True
        self._closed = False
        self._events = None
        if run_dir is not None and self.rank == 0:
            from stalwart.rundir import EventLog

            self._events = EventLog(Path(run_dir))
        install(self.tracker)

    # ---- switches ---------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Turn tracking and checks off/on (all ranks at the same point, e.g. the same step)."""
        self._enabled = on
        self.tracker.enabled = on
        self._last_hint = None

    def drain(self) -> None:
        """Wait until the exchanges in flight are complete (they stay queued and are read at
        their check as usual). Called at the same step on every rank; lets a caller that
        turns the monitor off charge their cost to the steps that issued them."""
        if self._rows is not None:  # nothing is in flight without a link
            for seq, _ in self._inflight:
                self._rows.wait(seq)

    # ---- inputs -----------------------------------------------------------------------------
    def step(self, step: int, metrics: dict[str, Any] | None = None) -> None:
        """Optional hint at the end of each training step (call on all ranks or none)."""
        if not self._enabled or self._closed:
            return
        c0 = time.thread_time()
        self._hinted = True
        now = time.perf_counter()
        m = metrics or {}
        since = self._last_hint
        self._last_hint = now
        seconds = m.get("step_time")
        compute, comm = m.get("compute_time"), m.get("comm_time")
        # the loop measures its own compute and communication: no record would be read
        self.tracker.recording = seconds is None or compute is None or comm is None
        if seconds is None:
            if since is None:
                return
            seconds = now - since
        if compute is None or comm is None:
            t0 = now - float(seconds)
            comm = comm_busy(self.tracker.recent(t0 - 1.0), t0, now)
            compute = float(seconds) - comm
        found = len(self.findings)
        self._sample(IterSample(step, float(seconds), float(compute), float(comm)))
        self._check()
        if len(self.findings) != found:
            self._last_hint = time.perf_counter()  # a validation pause is not step time
        else:
            self._step_cpu_us.append(1e6 * (time.thread_time() - c0))

    def _on_issue(self, rec: OpRecord) -> None:
        """Every tracked op, before it is issued: find iterations without hints."""
        if self._hinted or rec.numel < MIN_PERIOD_NUMEL or not self._enabled:
            return
        b = self.periods.push(hash((rec.op, rec.group, rec.numel)), time.perf_counter())
        if b is None:
            return
        key = self._iter
        self._iter += 1
        comm = comm_busy(self.tracker.recent(b.start - 1.0), b.start, b.end)
        self._sample(IterSample(key, b.end - b.start, b.end - b.start - comm, comm))
        self._check()

    # ---- detection --------------------------------------------------------------------------
    def _sample(self, s: IterSample) -> None:
        if self._skip_next:
            self._skip_next = False
            return
        self.samples.append(s)
        if self.rank != 0:
            return
        ch = self.detector.add(s.key, s.seconds)
        if ch is not None:
            self._classify(ch)
        if self._unexplained is not None:
            self._settle_unexplained(s.key)

    def _settle_unexplained(self, key: int, final: bool = False) -> None:
        """Rank 0: log an unexplained slowdown that lasted, count one that did not.

        Validation found no culprit; whether the job as a whole stays slower is what tells a
        real job-wide slowdown (load from elsewhere) from an OS hiccup of a few steps.
        """
        assert self._unexplained is not None
        fields, before, decided = self._unexplained
        if key - decided < self.persist and not final:
            return
        self._unexplained = None
        # lasting: the iteration times since the decision are above those before the onset,
        # by min_shift in the median and beyond chance in their ranks (a level of the last
        # 8 samples against a median of 20 read 1.36x on a clean local run whose step time
        # swings 17-48 ms from step to step: it was logged)
        after = [x.seconds for x in self.samples if decided < x.key <= key]
        healthy = statistics.median(before) if before else math.inf
        ratio = statistics.median(after) / healthy if after else 0.0
        z = rank_sum_z(np.asarray(before), np.asarray(after))
        lasting = ratio >= 1.0 + self.detector.min_shift and z >= LASTING_Z
        if lasting and key - decided >= self.persist:
            self.unexplained_logged += 1
            if self._events is not None:
                fields["evidence"] = dict(fields["evidence"],
                                          persisted_steps=key - fields["onset_step"],
                                          level_ratio=round(ratio, 3), rank_sum_z=round(z, 2))
                self._events.log("slowdown_unexplained", **fields)
        else:
            self._hiccup("job-wide slowdown that did not last", fields)
            log.debug("hiccup: slowdown at step %d (x%.2f) explained by no rank or link, "
                      "gone by step %d", fields["onset_step"], fields["severity"], key)

    def _hiccup(self, why: str, fields: dict[str, Any]) -> None:
        self.hiccups += 1
        self.hiccup_log.append({"why": why, **{k: fields.get(k) for k in (
            "step", "onset_step", "severity", "evidence")}})

    def _classify(self, ch: Change, channel: str = "iteration") -> None:
        if self._pending[0] != NONE or self._deciding:
            return  # a decision is already on its way
        if self._active is None:
            if ch.ratio > 1.0:
                self._healthy = ch.before
                self._channel = channel
                self._pending = (DETECT, ch.onset, ch.ratio, _suspect(channel))
            # a speed-up while healthy just moves the baseline
            return
        if ch.ratio > 1.0 and (ch.onset <= self._active.step or (
                self._active.kind == "compute" and _suspect(channel) in self._active.ranks)):
            # the slowdown already found, seen again (the iteration time and the culprit's
            # own compute move together; BOCD+V and CUSUM share a rank's channel): one fault,
            # one finding
            return
        if channel != self._channel:
            if ch.ratio > 1.0:  # another straggler while one is in progress
                # followed on its channel only if the tests confirm it is a new one
                self._switch_to = (channel, ch.before)
                self._pending = (DETECT, ch.onset, ch.ratio, _suspect(channel))
            return  # recoveries are followed on the channel that found the slowdown
        if ch.ratio > 1.0:
            self._pending = (DETECT, ch.onset, ch.after / (self._healthy or ch.before),
                             _suspect(channel))
        elif self._healthy is not None and ch.after <= self._healthy * (
                1.0 + self.detector.min_shift):
            self._pending = (RECOVER, ch.onset, ch.after / self._healthy, -1)

    def _relative(self, rows: list[list[float]], n: int) -> None:
        """Rank 0: each rank's compute time relative to the job's median, per step.

        A rank whose compute grows while its peers' does not is a compute straggler even when
        the job's iteration time moves little (its peers were waiting anyway, or got the CPU
        it lost): the per-rank relative score of NVIDIA's straggler detection, here fed to the
        same BOCD+V as the iteration time, one detector per rank, all updated together.
        """
        for j in range(n):  # the first n entries: every rank sent at least n
            key = int(rows[0][HEADER + 2 * j])
            comps = [r[HEADER + 2 * j + 1] for r in rows]
            if any(not c > 0 or not math.isfinite(c) for c in comps):
                continue
            med = statistics.median(comps)
            if not self.rel_detectors:
                # one bank: every rank's channel advances in one vector update per step
                bank = BOCPDBank(hazard=self.detector.hazard)
                # as strict per rank as the job size needs (cusum.per_rank_z)
                z = per_rank_z(len(comps))
                self.rel_detectors = {r: ChangeDetector(
                    warmup=self.detector.warmup, min_shift=0.15, z_sig=z, bank=bank)
                    for r in range(len(comps))}
            dets = [self.rel_detectors[r] for r in range(len(comps))]
            rel = [c / med for c in comps]
            if len(comps) > REF_RANKS:
                self._pool_noise(dets, rel)
            for r, ch in enumerate(ChangeDetector.add_many(dets, key, rel)):
                if ch is not None:
                    self._classify(ch, f"rank{r}")
            if self.cusum is None or self.cusum.n != len(comps):
                self.cusum = CusumBank(len(comps), warmup=self.detector.warmup)
            # small lasting shifts (a 1.3x throttle) that BOCD+V's verification lets pass;
            # the validation tests must still confirm the rank (cusum.py)
            for r, ch in enumerate(self.cusum.add(key, np.asarray(rel))):
                if ch is not None:
                    self._classify(ch, f"rank{r}")

    def _pool_noise(self, dets: list[ChangeDetector], rel: list[float]) -> None:
        """A floor under every per-rank channel's noise scale: ``POOLED_FLOOR`` x the median
        of recent cross-rank spreads (1.4826 MAD of log relative compute over all ranks).

        Why: each channel learns its noise from its own first 8 samples (BOCD+V) or 18
        (CUSUM), an estimate that is often far too small; among thousands of ranks the
        smallest ones are, and those channels alarm on noise. In one step every rank gives
        a sample of the same noise, so at scale the pooled spread is known well after a few
        steps. Up to REF_RANKS ranks (the size the thresholds were tuned on) nothing
        changes. Cost: one vector median per step, an O(N) loop when the floor moves > 20%."""
        x = np.log(np.asarray(rel))
        self._spreads.append(float(1.4826 * np.median(np.abs(x - np.median(x)))))
        if len(self._spreads) < 4:
            return
        floor = POOLED_FLOOR * statistics.median(self._spreads)
        if self._floor is not None and abs(floor / self._floor - 1.0) <= 0.2:
            return
        if self._floor is None:  # the floors the channels were built with
            self._own_floors = (dets[0].min_scale,
                                self.cusum.min_sigma if self.cusum is not None else 0.0)
        self._floor = floor
        for d in dets:
            d.min_scale = max(self._own_floors[0], floor)
        if self.cusum is not None:
            self.cusum.min_sigma = max(self._own_floors[1], floor)

    def _group(self) -> Any:
        """The monitor's own gloo group: its traffic never queues behind training's."""
        if self._pg is None:
            # collective: every rank constructs its monitor at the same point
            self._pg = dist.new_group(backend="gloo")
        return self._pg

    def _check(self) -> None:
        """Collective: rank 0's decision reaches every rank; act on it together.

        Every rank contributes one small row -- rank 0's pending decision and next exchange
        period, and each rank's compute time of every step since the last exchange -- to an
        asynchronous all-gather on the monitor's own group, issued every ``check_every``
        checks and read at a check fixed when it was issued (the next one, or ``lag``
        exchanges later with a fixed period): no rank ever blocks on it (it is long complete
        by then), and every rank reads the same rows at the same checks.
        """
        self._checks += 1
        c = self._checks
        last = self.samples[-1] if self.samples else None
        if last is not None and last.compute and last.key != self._last_key:
            self._last_key = last.key  # a skipped sample leaves the last one in place
            self._unsent.append((float(last.key), float(last.compute)))
        distributed = dist.is_available() and dist.is_initialized() and self.world > 1
        if not distributed:
            if c < self._next_issue:
                return
            self._next_issue = c + self.check_every
            action, onset, severity, suspect = self._pending
            self._pending = (NONE, 0, 0.0, -1)
            self._unsent.clear()
        else:
            if self.rank == 0:
                cpu = time.process_time()
                if self._cpu_at_check is not None:
                    self._step_cpu.append(cpu - self._cpu_at_check)
                self._cpu_at_check = cpu
            got = self._read(c)
            if c >= self._next_issue:
                self._issue(c)
            if got is None:
                return
            action, onset, severity = int(got[0][0]), int(got[0][1]), float(got[0][2])
            suspect = int(got[0][3])
        if action == NONE:
            return
        decided = self.samples[-1].key if self.samples else onset
        if action == DETECT:
            self._on_detect(onset, decided, severity, distributed,
                            suspect if suspect >= 0 else None)
        else:
            self._on_recover(onset, decided, severity)

    def _read(self, c: int) -> list[list[float]] | None:
        """The rows due at check ``c``, if any (rank 0: every rank's; the others: rank 0's);
        applies rank 0's exchange period."""
        if not self._inflight or self._inflight[0][1] > c:
            return None
        assert self._rows is not None
        t0 = time.thread_time()
        seq, _ = self._inflight.popleft()
        got = self._rows.read(seq)
        if self.rank == 0:
            self._exchange_cpu = (self._exchange_cpu or 0.0) + time.thread_time() - t0
        if self.auto_every:
            # rank 0's choice (it folds in the other ranks' requests), read by every rank at
            # this same check
            self.check_every = max(1, min(int(got[0][5]), self.max_every))
            self._next_issue = min(self._next_issue, self._last_issue + self.check_every)
        if self.rank == 0:
            # the other ranks' requests (rank 0's own row holds its last choice, which
            # must not vote for itself: once 1, the period would stay 1)
            self._requested = min((int(r[5]) for r in got[1:]), default=self.max_every)
            self._relative(got, min(int(r[4]) for r in got))
            if got[0][0] != NONE:
                # only now: a change found in these rows is the slowdown this decision is
                # about, not a second one (the decision is applied right after this read)
                self._deciding -= 1
        return got

    def _issue(self, c: int) -> None:
        """Send this rank's row (and rank 0's pending decision) to every rank."""
        t0 = time.thread_time()
        action, onset, severity, suspect = self._pending
        self._pending = (NONE, 0, 0.0, -1)
        if action != NONE:
            self._deciding += 1
        # the same length on every rank; a rank with fewer samples sends fewer entries and
        # rank 0 uses the entries every rank has
        width = self._width()
        unsent = self._unsent[-self.max_every:]
        self._unsent.clear()
        vals = [float(action), float(onset), float(severity), float(suspect),
                float(len(unsent)),
                float(self._choose_every(c) if self.rank == 0 else self._request_every(unsent))]
        for key, comp in unsent:
            vals += (key, comp)
        vals += [0.0] * (width - len(vals))
        due = c + 1 if self.auto_every else c + self.lag * self.check_every
        assert self._rows is not None
        self._rows.issue(self.exchanges, vals)
        self._inflight.append((self.exchanges, due))
        self._last_issue = c
        self._next_issue = c + self.check_every
        self.exchanges += 1
        if self.rank == 0:
            self._exchange_cpu = (self._exchange_cpu or 0.0) + time.thread_time() - t0

    def _request_every(self, unsent: list[tuple[float, float]]) -> int:
        """Ranks other than 0: ask for one exchange per step when this rank's own compute
        time stands out -- a cheap pre-filter (two samples in a row above its recent median
        by ``ALERT_JUMP``), so that a rank turning slow gets its next samples to rank 0
        without batching."""
        hist = self._own_compute
        alert = False
        for _, comp in unsent:
            # two samples in a row: single spikes are everyday noise on a loaded machine
            high = len(hist) >= 8 and comp > (1.0 + ALERT_JUMP) * statistics.median(hist)
            alert = alert or (high and self._own_high)
            self._own_high = high
            hist.append(comp)
        return 1 if alert else self.max_every

    def _width(self) -> int:
        return HEADER + 2 * self.max_every

    def _link(self) -> StarRows | GlooRows:
        """Collective: the exchange's path (rowlink.py) -- direct sockets to rank 0, or, if
        any rank could not set them up, the monitor group's all-gather."""
        pg = self._group()
        link: StarRows | GlooRows | None = None
        try:
            # the lossy transport's rule for this rank's address (the interface that reaches
            # MASTER_ADDR, or the testbed's): rank 0's is the one that matters
            link = StarRows(self.rank, self.world, self._width(), pg, default_host(),
                            timeout=LINK_SETUP_S)
        except OSError as e:
            log.debug("monitor row link not set up (%s): using the gloo all-gather", e)
        ok = torch.tensor([0.0 if link is None else 1.0])
        with self.tracker.internal():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg)
        if ok.item() == 1.0:
            assert isinstance(link, StarRows)
            link.set_timeout(READ_TIMEOUT_S)
            return link
        if link is not None:
            link.close()
        return GlooRows(self.rank, self.world, self._width(), pg)

    def _choose_every(self, c: int) -> int:
        """Rank 0: steps until the next exchange after this one is read.

        The smallest k that keeps the exchange within ``EXCHANGE_BUDGET`` of the process's
        CPU time per step (both measured here: the exchange's cost is the larger of the
        calibrated process cost and the median of the last exchanges on this thread),
        capped at ``max_every``; 1 while a change detector's posterior has fired or a
        decision is on its way, so that batching never delays a verdict.
        """
        if not self.auto_every:
            return self.check_every
        dets = [self.detector, *self.rel_detectors.values()]
        if self._pending[0] != NONE or self._deciding or self._requested <= 1 or any(
                d.pending for d in dets):
            self._alert_until = c + ALERT_CHECKS
        per_exchange = self._exchange_cpu
        self._exchange_cpu = 0.0  # the next exchange's cost accumulates from here
        if per_exchange is not None and per_exchange > 0:
            self._exchange_costs.append(per_exchange)
        if c < self._alert_until or len(self._exchange_costs) < 3 or len(self._step_cpu) < 3:
            return 1
        cost = max(statistics.median(self._exchange_costs), self._exchange_process_cpu)
        step_cpu = statistics.median(self._step_cpu)
        if not step_cpu > 0:
            return 1
        return max(1, min(self.max_every, math.ceil(cost / (EXCHANGE_BUDGET * step_cpu))))

    def _evidence(self, onset: int, decided: int) -> RankEvidence:
        before = [s for s in self.samples if onset - BEFORE <= s.key < onset]
        after = [s for s in self.samples if onset <= s.key <= decided]

        def med(xs: list[IterSample], attr: str) -> float | None:
            vals = [getattr(s, attr) for s in xs if getattr(s, attr) is not None]
            return statistics.median(vals) if vals else None

        # what culprit_onset splits: the window it searches and the baseline before it
        recent = [(s.key, s.compute) for s in self.samples
                  if s.compute and onset - ONSET_SLACK - BEFORE <= s.key <= decided]
        return RankEvidence(self.rank, med(before, "compute"), med(after, "compute"),
                            med(before, "comm"), med(after, "comm"), recent=recent)

    def _on_detect(self, onset: int, decided: int, severity: float, distributed: bool,
                   suspect: int | None = None) -> None:
        ev = self._evidence(onset, decided)
        t0 = time.perf_counter()
        if distributed and self.validate_on_detect:
            with self.tracker.internal():
                pg = self._group()
                dev, link_dev, link_pg = self._test_device()
                ev.compute_rounds = validate.compute_test(reps=self.compute_reps, group=pg,
                                                          device=dev)
                ev.compute_test = statistics.median(ev.compute_rounds)
                ring = validate.ring_pair_passes(self.world)
                ev.links = {f"{a}-{b}": t for (a, b), t in validate.link_test(
                    ring, self.rank, self.link_bytes, group=link_pg, device=link_dev).items()}
                gathered = self._gather(ev)
                while extra_rounds := more_rounds(gathered, suspect):
                    # a mild straggler: the verdict waits for a longer test (every rank
                    # computed the same answer from the same gathered evidence; at most
                    # twice: 3 -> 7 -> 10 rounds)
                    ev.compute_rounds += validate.compute_test(
                        reps=self.compute_reps, rounds=extra_rounds, group=pg, device=dev)
                    ev.compute_test = statistics.median(ev.compute_rounds)
                    gathered = self._gather(ev)
                finding = decide(gathered, onset, decided, severity, suspect)
                tested = {p for ps in ring for p in ps}
                extra = validate.round_robin_passes(self.world, tested)
                if finding.kind == "unknown" and extra and self.world <= 16:
                    # a slow link between hosts that are not ring neighbours
                    ev.links.update({f"{a}-{b}": t for (a, b), t in validate.link_test(
                        extra, self.rank, self.link_bytes, group=link_pg,
                        device=link_dev).items()})
                    finding = decide(self._gather(ev), onset, decided, severity, suspect)
        else:
            finding = decide([ev], onset, decided, severity, suspect)
        pause = round(time.perf_counter() - t0, 3)
        self._skip_next = not self._hinted  # this iteration holds the pause
        switch_to, self._switch_to = self._switch_to, None
        if self._active is not None and (finding.kind == "unknown" or (
                finding.kind, finding.ranks, finding.link) == (
                self._active.kind, self._active.ranks, self._active.link)):
            # while a straggler is active: its own slowdown seen by a channel that lags (the
            # same verdict again), or nothing the tests confirm -- not a new finding, and the
            # active one stays followed on its channel
            if finding.kind == "unknown":
                self._hiccup("nothing confirmed while a straggler is active",
                             finding.event_fields())
            else:
                self._repeats += 1
            return
        if switch_to is not None:
            self._channel, self._healthy = switch_to
        self.findings.append(finding)
        # an unexplained slowdown has no culprit to watch for recovery
        self._active = finding if finding.kind != "unknown" else None
        if self.rank != 0:
            return
        fields = finding.event_fields()
        fields["evidence"] = dict(fields["evidence"], validation_s=pause)
        if suspect is not None and self.cusum is not None:
            # a rank's own channel pointed at it: an alarm the tests did not confirm makes
            # that rank's next CUSUM alarm need more evidence (bounded validation pauses)
            if finding.kind == "compute" and finding.ranks == [suspect]:
                self.cusum.confirmed(suspect)
            else:
                self.cusum.unconfirmed(suspect)
        if finding.kind == "unknown" and suspect is not None:
            # one rank's compute moved relative to its peers and the tests found nothing
            # (load from elsewhere shifting CPU shares, or a rank that is not slow now):
            # not a job-wide slowdown to report, a hiccup
            self._hiccup(f"rank {suspect}'s compute rose; the compute test did not confirm it",
                         fields)
            log.debug("hiccup: rank %d's compute rose at step %d (x%.2f), not confirmed "
                      "by the compute test", suspect, onset, severity)
            return
        if finding.kind == "unknown":
            # Validation is what makes a slowdown a straggler (FALCON): when it names no rank
            # or link, the job as a whole slowed (load from elsewhere) or something passed
            # (an OS hiccup, a fault already gone). Only a slowdown that lasts is logged.
            if self._unexplained is None:
                # the iteration time before the onset (the channel that fired may be a
                # per-rank ratio): what the job's speed must stay above to count as lasting
                before = [x.seconds for x in self.samples if onset - BEFORE <= x.key < onset]
                self._unexplained = (fields, before, decided)
            return
        if self._unexplained is not None:
            # a culprit was found after all: the earlier slowdown was its start or a hiccup
            self._hiccup("unexplained slowdown, then a culprit found", self._unexplained[0])
            self._unexplained = None
        if self._events is not None:
            self._events.log("straggler_detected", **fields)

    def _test_device(self) -> tuple[Any, Any, Any]:
        """Where the validation tests run: (compute device, link buffers' device, link group).

        ``validate.validation_device`` decides from the default group's backend string:
        a CPU job (gloo, or no CUDA) tests its CPU and links on the monitor's gloo group; a
        job whose default group carries CUDA tensors ("nccl", "cpu:gloo,cuda:nccl",
        "undefined" with CUDA) tests its own GPU and sends device buffers over its default
        group -- the path its gradients take (not run here: no GPU on the testbed).
        """
        if self.device is not None:  # the caller said where the job computes
            if self.device.type != "cuda":
                return None, None, self._group()
            if validate.cuda_backend(dist.get_backend(), True) is not None:
                return self.device, self.device, None  # device buffers, the job's backend
            # ranks sharing GPUs over gloo: gloo's send/recv move host buffers only, so
            # the link test runs as a CPU job's would
            return self.device, None, self._group()
        cuda = torch.cuda.is_available()
        try:
            local_rank: int | None = int(os.environ["LOCAL_RANK"])
        except (KeyError, ValueError):
            local_rank = None
        # only a job that initialised CUDA can have chosen a current device; asking an
        # uninitialised one would create a CUDA context in a CPU job
        current = torch.cuda.current_device() if cuda and torch.cuda.is_initialized() else None
        path = validate.validation_device(dist.get_backend(), cuda, local_rank, current,
                                          torch.cuda.device_count() if cuda else None)
        if path.link_group == "default":
            return torch.device(path.device), torch.device(path.device), None
        return None, None, self._group()

    def _gather(self, ev: RankEvidence) -> list[RankEvidence]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, asdict(ev), group=self._group())
        return [RankEvidence(**d) for d in out]

    def _on_recover(self, onset: int, decided: int, level: float) -> None:
        f = self._active
        self._active = None
        if f is None:
            return
        f.recovered_step = onset
        if self._events is not None and f.kind != "unknown":
            fields = {"step": decided, "onset_step": onset, "kind": f.kind, "ranks": f.ranks,
                      "detected_step": f.step, "detected_onset_step": f.onset_step,
                      "severity": round(level, 3)}
            if f.link is not None:
                fields["link"] = f.link
            self._events.log("straggler_recovered", **fields)

    # ---- outputs ----------------------------------------------------------------------------
    def report(self) -> list[dict[str, Any]]:
        """Findings so far (every rank has the same verdicts), oldest first."""
        out = []
        for f in self.findings:
            d = f.event_fields()
            d["recovered_step"] = f.recovered_step
            out.append(d)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # every rank issued them: completing them keeps the group's op order intact
        if self._rows is not None:
            while self._inflight:
                self._rows.read(self._inflight.popleft()[0])
            self._rows.close()
        uninstall(self.tracker)
        if self._unexplained is not None:
            last = self.samples[-1].key if self.samples else self._unexplained[2]
            self._settle_unexplained(last, final=True)
        if self.rank == 0 and self._run_dir is not None:
            try:
                (self._run_dir / STATS_FILE).write_text(json.dumps(self.stats(), indent=1))
            except OSError as e:  # statistics are a convenience, never a failure
                log.debug("could not write %s: %s", STATS_FILE, e)
        if self._events is not None:
            self._events.close()

    def stats(self) -> dict[str, Any]:
        """The monitor's counters: hiccups, logged unexplained slowdowns, exchanges, cost."""
        cpu = sorted(self._step_cpu_us)
        return {"hiccups": self.hiccups, "unexplained_logged": self.unexplained_logged,
                "repeat_verdicts": self._repeats, "hiccup_log": list(self.hiccup_log),
                "findings": len(self.findings), "checks": self._checks,
                "exchanges": self.exchanges, "check_every": self.check_every,
                "monitor_step_cpu_us_median": round(cpu[len(cpu) // 2], 1) if cpu else None}

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
