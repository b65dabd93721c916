"""The tracking-overhead job of ``stalwart bench detect`` (one rank of it).

One 4-rank job (local testbed) trains the built-in GPT with the monitor enabled and disabled
on alternating steps (ABBA order) inside the same processes; overhead = geometric mean of the
paired steps' ratios - 1, with its 95% interval (an "on" step followed by an "off" one waits
for its exchange to complete, so no monitor work runs on into an "off" step), plus the time
spent inside ``monitor.step`` as a fraction of step time and its CPU time
(``monitor_step_cpu_us_median``, bench detect's ``monitor_step_cpu_us``: rank 0's CPU time
for the monitor per monitored step, in microseconds, analysis amortised in -- its training
thread's CPU inside ``monitor.step`` (keeping the sample, and at the steps with an exchange
due reading its own row's header and handing the rest over) plus its analysis thread's CPU
(detect/monitor.py: the samples held since the last check and the other ranks' rows through
the decision path, and its row's send), each job's counted at the "on" step by whose end it
finished; amortised: the median over windows of 16 monitored steps of their mean, so a step
whose check analyses eight samples counts at its share and one validation pause is one
window the median leaves out). ``monitor_step_cpu_us_training_thread`` is the same for the
training thread alone, ``monitor_analysis_cpu_us_per_step`` the analysis thread's total over
the monitored steps, ``monitor_step_cpu_us_per_step_median`` the training thread's plain
per-step median, ``per_step`` every monitored step's (kind -- "held" or "check", "+drain"
where the schedule drained -- training thread us, analysis us), ``clock_pair_us_median``
what the two thread-CPU clock reads around ``end_step`` cost alone after an "off" step (part
of every step's figure); the process's CPU overhead counts both threads. The monitor
exchanges every ``--check-every`` steps (default 8, fixed: ``Monitor(check_every=8)``; a
decision then waits up to 2 x 8 steps for its rows), or with 0 at a period it chooses up to
``--max-every`` (default 8), which falls to 1 while a rank's compute jumps (on a loaded
machine: most of the time); with 1 every step exchanges and analyses its own sample.

Started by the launcher like any rank: ``python -m stalwart.bench.detect_overhead --config
CFG --overhead-steps N``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the worker imports torch and the monitor only when it runs
    from stalwart.detect import Monitor


# ---- the overhead worker (one rank) ---------------------------------------------------------
# a directory: every rank profiles its monitored steps' ``monitor.step`` (cProfile, thread
# CPU clock) into rankR-step.pstats, and rank 0 its analysis thread's jobs into
# rank0-analysis.pstats (a by-hand measurement: tests/detect/step_cost.py overhead --profile)
PROFILE_ENV = "STALWART_OVERHEAD_PROFILE"


# a directory: every rank times the monitor's phases (thread CPU per call, inclusive, by
# thread) into rankR-phases.json -- less disturbed than cProfile (~1 us per timed call)
PHASES_ENV = "STALWART_OVERHEAD_PHASES"
PHASES = (
    ("stalwart.detect.monitor", "Monitor", ("step", "_check", "_join_held", "_sampled",
                                            "_after", "_analyse", "_decide")),
    ("stalwart.detect.detector", "Detector", ("step",)),
    ("stalwart.detect.decision", "DecisionCore", (
        "sample_many", "sample", "relative_rows", "relative", "_batch_args", "take_pending",
        "classify", "step_seconds")),
    ("stalwart.detect.changepoint", "ChangeDetector", ("after_push", "_verify",
                                                       "_start_bocpd")),
    ("stalwart.detect.changepoint", "DetectorGroup", ("row_steps",)),
    ("stalwart.detect.cusum", "CusumBank", ("after_step",)),
    ("stalwart.detect.outlier", "OutlierBank", ("_test", "crit_table")),
    ("stalwart.detect.exchange", "Exchange", ("read", "read_own", "read_rows", "reserve",
                                              "send", "issue")),
    ("stalwart.rowlink", "StarRows", ("read", "issue", "wait")),
)


def _phase_timer(rank: int) -> Any:
    """When ``PHASES_ENV`` is set: the methods in ``PHASES`` wrapped to add their thread
    CPU time to a table by (thread, Class.method); a function that writes it, else None."""
    out = os.environ.get(PHASES_ENV)
    if not out:
        return None
    import functools
    import importlib
    import threading

    table: dict[str, list[float]] = {}
    clock = time.thread_time

    def wrap(name: str, f: Any) -> Any:
        @functools.wraps(f)
        def timed(*a: Any, **k: Any) -> Any:
            c0 = clock()
            try:
                return f(*a, **k)
            finally:
                key = f"{threading.current_thread().name}:{name}"
                e = table.setdefault(key, [0, 0.0])
                e[0] += 1
                e[1] += clock() - c0
        return timed

    for mod, cls_name, names in PHASES:
        cls = getattr(importlib.import_module(mod), cls_name)
        for n in names:
            setattr(cls, n, wrap(f"{cls_name}.{n}", getattr(cls, n)))

    def write(extra: dict[str, Any]) -> None:
        rows = {k: {"calls": int(c), "cpu_us": round(1e6 * t, 1)}
                for k, (c, t) in sorted(table.items())}
        (Path(out) / f"rank{rank}-phases.json").write_text(
            json.dumps({"phases": rows, **extra}, indent=1) + "\n")
    return write


def _profiler(rank: int) -> Any:
    """The training thread's profiler when ``PROFILE_ENV`` is set, else None; on rank 0
    the analysis thread's jobs are profiled too (``Analysis.submit`` wrapped), written at
    exit."""
    out = os.environ.get(PROFILE_ENV)
    if not out:
        return None
    import atexit
    import cProfile

    from stalwart.detect import monitor as monitor_mod

    if rank == 0:
        job_prof = cProfile.Profile(time.thread_time)
        submit = monitor_mod.Analysis.submit

        def profiled(self: Any, job: Any) -> None:
            def run() -> None:
                job_prof.enable()
                try:
                    job()
                finally:
                    job_prof.disable()
            submit(self, run)

        monitor_mod.Analysis.submit = profiled  # type: ignore[method-assign]
        atexit.register(lambda: job_prof.dump_stats(Path(out) / "rank0-analysis.pstats"))
    return cProfile.Profile(time.thread_time)


def _paired(xs: list[tuple[bool, float]]) -> tuple[float, float]:
    """Mean log(on/off) over consecutive (on, off) / (off, on) pairs, and its 95% half-width."""
    logs = []
    for i in range(0, len(xs) - 1, 2):
        (a_on, a), (_, b) = xs[i], xs[i + 1]
        if a > 0 and b > 0:
            logs.append(math.log(a / b) if a_on else math.log(b / a))
    mean = statistics.fmean(logs)
    return mean, 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))


ABBA = (True, False, False, True)  # monitor on/off per step: a linear drift cancels in 4 steps


def abba(step: int, warm: int) -> tuple[bool, bool]:
    """(monitor on at ``step``, drain its exchanges at the end of it): on through warm-up,
    then ABBA; an "on" step followed by an "off" one drains, so the exchange it issued is
    complete before the off step begins and its cost stays with the on step."""
    on = step < warm or ABBA[(step - warm) % 4]
    nxt = step + 1 < warm or ABBA[(step + 1 - warm) % 4]
    return on, on and not nxt


def begin_step(mon: Monitor, step: int, warm: int) -> bool:
    """Switch the monitor on or off for ``step`` as the schedule says (every rank at the
    same step); returns whether it is on."""
    on = abba(step, warm)[0]
    mon.enabled = on
    return on


def end_step(mon: Monitor, step: int, warm: int, metrics: dict[str, float]) -> None:
    """The monitor's part of the end of ``step``: its step hint, then, where the schedule
    says (``abba``), a drain -- the next step runs with the monitor off, and the exchange
    this step issued must not run on into it: its cost belongs to this "on" step."""
    mon.step(step, metrics)
    if abba(step, warm)[1]:
        mon.drain()


def overhead_worker(cfg_path: Path, steps: int, check_every: int | None = None,  # noqa: PLR0915
                    max_every: int = 8) -> int:  # one ABBA measurement, in order
    """DDP training with the Monitor on and off on alternating steps (ABBA), same process.

    Every rank switches at the same step. Steps pair up as (on, off), (off, on), ...; the
    overhead is the geometric mean of the pairs' ratios - 1, with a 95% interval. The time
    spent inside ``monitor.step`` (detector, decision broadcast) is reported separately.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from stalwart.config import RunConfig
    from stalwart.detect import Monitor
    from stalwart.detect.monitor import amortised
    from stalwart.train.data import load_corpus, train_batch
    from stalwart.train.model import GPT, PRESETS

    cfg = RunConfig.load(cfg_path)
    rank = int(os.environ["RANK"])
    prof = _profiler(rank)
    phases = _phase_timer(rank)
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    run_dir = Path(os.environ["STALWART_RUN_DIR"])
    # the exchange period stalwart's worker uses for reliable communication (None: the
    # monitor batches exchanges, src/stalwart/train/worker.py): the figure is the cost of
    # what `stalwart run` does
    mon = Monitor(run_dir=None, rank=rank, world=world, check_every=check_every,
                  max_every=max_every)
    torch.manual_seed(cfg.train.seed)
    mcfg = PRESETS[cfg.train.preset]["model"]
    model = DDP(GPT(mcfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = load_corpus(cfg.train.data, cfg.train.max_data_bytes)
    bs = cfg.resolved_batch_size()
    warm = 12
    dts: list[tuple[bool, float]] = []
    cpus: list[tuple[bool, float]] = []
    in_step: list[float] = []
    in_step_cpu: list[float] = []
    in_analysis: list[float] = []  # rank 0's analysis thread CPU landed in each "on" step
    clock_pair: list[float] = []  # two thread-CPU clock reads after an "off" step
    kinds: list[str] = []  # each "on" step's kind: "held" or "check", "+drain" if it drained
    analysed = mon.analysis_cpu_us
    for step in range(warm + steps):
        on = begin_step(mon, step, warm)
        x, y = train_batch(corpus, bs, mcfg.block_size, cfg.train.seed, step, rank, 0)
        t0 = time.perf_counter()
        c0 = time.process_time()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        if not on and step >= warm:  # what the two clock reads alone cost here (the floor)
            f0 = time.thread_time()
            clock_pair.append(time.thread_time() - f0)
        m0 = time.thread_time()
        if prof is not None and on and step >= warm:
            prof.enable()
        # as stalwart's worker does: the loop reports its compute and communication split
        # (so the tracker keeps no records; their split does not matter here)
        end_step(mon, step, warm, {"step_time": t1 - t0, "compute_time": t1 - t0,
                                   "comm_time": 0.0})
        if prof is not None:
            prof.disable()
        m1 = time.thread_time()
        t2 = time.perf_counter()
        c2 = time.process_time()
        if step >= warm:
            dts.append((on, t2 - t0))
            cpus.append((on, c2 - c0))
            if on:
                in_step.append(t2 - t1)
                in_step_cpu.append(m1 - m0)
                # (a check takes every held sample: none is held after it)
                kinds.append(("held" if mon._n_held else "check")
                             + ("+drain" if abba(step, warm)[1] else ""))
                # the analysis jobs finished since the last "on" step's end: every one
                # submitted in an "on" step is done by the end of the next (its ``drain``
                # or the next check's wait), so none lands in an "off" step
                done = mon.analysis_cpu_us
                in_analysis.append(1e-6 * (done - analysed))
                analysed = done
        elif on:
            analysed = mon.analysis_cpu_us
    mon.close()
    if phases is not None:
        st = mon.stats()
        phases({"monitored_steps": len(in_step_cpu), "checks": st.get("checks"),
                "exchanges": st.get("exchanges"),
                "analysed_off_thread": st.get("analysed_off_thread"),
                "training_thread_cpu_us": round(1e6 * sum(in_step_cpu), 1)})
    if prof is not None:
        prof.dump_stats(Path(os.environ[PROFILE_ENV]) / f"rank{rank}-step.pstats")
    if rank == 0:
        mean, half = _paired(dts)
        cmean, chalf = _paired(cpus)
        on_times = [d for o, d in dts if o]
        total = [a + b for a, b in zip(in_step_cpu, in_analysis, strict=True)]
        out = {"overhead": math.exp(mean) - 1.0, "pairs": len(dts) // 2,
               "ci95": [math.exp(mean - half) - 1, math.exp(mean + half) - 1],
               # the same pairing on this process's CPU time (all its threads): what the
               # monitor adds in work, much less disturbed by other jobs on the machine
               "cpu_overhead": math.exp(cmean) - 1.0,
               "cpu_ci95": [math.exp(cmean - chalf) - 1, math.exp(cmean + chalf) - 1],
               "median_step_on": statistics.median(on_times),
               "median_step_off": statistics.median([d for o, d in dts if not o]),
               "monitor_step_s_median": statistics.median(in_step),
               "monitor_step_s_quantiles": [round(q, 6) for q in
                                            statistics.quantiles(in_step, n=10)],
               "monitor_step_fraction": sum(in_step) / sum(on_times),
               # the figure: training thread + analysis thread, per monitored step
               "monitor_step_cpu_us_median": round(
                   1e6 * statistics.median(amortised(total)), 1),
               "monitor_step_cpu_us_mean": round(1e6 * statistics.fmean(total), 1),
               # the training thread alone (what ``monitor.step`` costs the loop's thread)
               "monitor_step_cpu_us_training_thread": round(
                   1e6 * statistics.median(amortised(in_step_cpu)), 1),
               "monitor_step_cpu_us_training_thread_mean": round(
                   1e6 * statistics.fmean(in_step_cpu), 1),
               "monitor_step_cpu_us_per_step_median": round(
                   1e6 * statistics.median(in_step_cpu), 1),
               "monitor_step_cpu_us_quantiles": [round(1e6 * q, 1) for q in
                                                 statistics.quantiles(in_step_cpu, n=10)],
               # the analysis thread's CPU per monitored step (its total over the steps)
               "monitor_analysis_cpu_us_per_step": round(1e6 * statistics.fmean(in_analysis),
                                                         1),
               # the part of every training-thread figure that is the two clock reads
               "clock_pair_us_median": round(1e6 * statistics.median(clock_pair), 2),
               # every monitored step: (kind, training thread us, analysis us landed in it)
               "per_step": [(k, round(1e6 * a, 1), round(1e6 * b, 1)) for k, a, b in
                            zip(kinds, in_step_cpu, in_analysis, strict=True)],
               "monitor": mon.stats(), "check_every_arg": check_every,
               "max_every_arg": max_every, "nproc": world}
        (run_dir / "overhead.json").write_text(json.dumps(out, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stalwart.bench.detect_overhead")
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--overhead-steps", type=int, default=200)
    ap.add_argument("--check-every", type=int, default=8,
                    help="the monitor's exchange period (default 8: the analysis runs at "
                         "one step in 8, on the samples held since); 0: chosen by the "
                         "monitor, up to --max-every")
    ap.add_argument("--max-every", type=int, default=8,
                    help="the most steps per exchange the monitor may choose (default 8)")
    a = ap.parse_args(argv)
    return overhead_worker(a.config, a.overhead_steps, a.check_every or None, a.max_every)


if __name__ == "__main__":
    sys.exit(main())
