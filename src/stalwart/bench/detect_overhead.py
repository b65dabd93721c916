"""The tracking-overhead job of ``stalwart bench detect`` (one rank of it).

One 4-rank job (local testbed) trains the built-in GPT with the monitor enabled and disabled
on alternating steps (ABBA order) inside the same processes; overhead = geometric mean of the
paired steps' ratios - 1, with its 95% interval (an "on" step followed by an "off" one waits
for its exchange to complete, so no monitor work runs on into an "off" step), plus the time
spent inside ``monitor.step`` as a fraction of step time and its CPU time
(``monitor_step_cpu_us_median``: rank 0's training thread's CPU time inside ``monitor.step``
on monitored steps -- keeping the sample, and at the steps with an exchange due reading its
own row's header and handing the rest over -- in microseconds, amortised: the median over
windows of 16 monitored steps of their mean, so a step that analyses eight samples counts at
its share and one validation pause is one window the median leaves out; the plain per-step
median is ``monitor_step_cpu_us_per_step_median``). The analysis of the samples held since
the last check and the other ranks' rows runs on rank 0's analysis thread (detect/monitor.py):
its CPU is not in that figure; ``monitor_analysis_cpu_us_median`` in detect_stats.json gives
it per check, and the process's CPU overhead counts it. The monitor exchanges every
``--check-every`` steps (default 8, fixed: ``Monitor(check_every=8)``; a decision then waits
up to 2 x 8 steps for its rows), or with 0 at a period it chooses up to ``--max-every``
(default 8), which falls to 1 while a rank's compute jumps (on a loaded machine: most of the
time); with 1 every step exchanges and analyses its own sample.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the worker imports torch and the monitor only when it runs
    from stalwart.detect import Monitor


# ---- the overhead worker (one rank) ---------------------------------------------------------
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


def overhead_worker(cfg_path: Path, steps: int, check_every: int | None = None,
                    max_every: int = 8) -> int:
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
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    run_dir = Path(os.environ["STALWART_RUN_DIR"])
    # the exchange period stalwart's worker uses for reliable communication (None: the
    # monitor batches exchanges, src/stalwart/train/worker.py): the figure is the cost of
    # what `stalwart run` does
    mon = Monitor(run_dir=None, rank=rank, world=world, check_every=check_every,
                  max_every=max_every)
    torch.manual_seed(cfg.seed)
    mcfg = PRESETS[cfg.preset]["model"]
    model = DDP(GPT(mcfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = load_corpus(cfg.data, cfg.max_data_bytes)
    bs = cfg.resolved_batch_size()
    warm = 12
    dts: list[tuple[bool, float]] = []
    cpus: list[tuple[bool, float]] = []
    in_step: list[float] = []
    in_step_cpu: list[float] = []
    for step in range(warm + steps):
        on = begin_step(mon, step, warm)
        x, y = train_batch(corpus, bs, mcfg.block_size, cfg.seed, step, rank, 0)
        t0 = time.perf_counter()
        c0 = time.process_time()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        m0 = time.thread_time()
        # as stalwart's worker does: the loop reports its compute and communication split
        # (so the tracker keeps no records; their split does not matter here)
        end_step(mon, step, warm, {"step_time": t1 - t0, "compute_time": t1 - t0,
                                   "comm_time": 0.0})
        m1 = time.thread_time()
        t2 = time.perf_counter()
        c2 = time.process_time()
        if step >= warm:
            dts.append((on, t2 - t0))
            cpus.append((on, c2 - c0))
            if on:
                in_step.append(t2 - t1)
                in_step_cpu.append(m1 - m0)
    mon.close()
    if rank == 0:
        mean, half = _paired(dts)
        cmean, chalf = _paired(cpus)
        on_times = [d for o, d in dts if o]
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
               "monitor_step_cpu_us_median": round(
                   1e6 * statistics.median(amortised(in_step_cpu)), 1),
               "monitor_step_cpu_us_mean": round(1e6 * statistics.fmean(in_step_cpu), 1),
               "monitor_step_cpu_us_per_step_median": round(
                   1e6 * statistics.median(in_step_cpu), 1),
               "monitor_step_cpu_us_quantiles": [round(1e6 * q, 1) for q in
                                                 statistics.quantiles(in_step_cpu, n=10)],
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
