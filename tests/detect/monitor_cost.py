"""Where the Monitor's per-step time goes: a by-hand measurement script (not a test).

Runs N gloo ranks on loopback training the tiny GPT with DDP, the monitor enabled and
disabled on alternating steps (ABBA, as ``stalwart bench detect`` does), and accounts the
CPU time (``time.thread_time`` of the calling thread) spent in each part of the monitor:
the tracking wrappers per collective and per DDP bucket, ``monitor.step`` as a whole, the
exchange of rows (issue + wait of the all-gather), the change-point updates (iteration time
and per-rank channels), and the completion callbacks run on other threads. Thread wake-ups
are counted as context switches of all the process's threads on monitored vs unmonitored
steps.

    python tests/detect/monitor_cost.py --nproc 4 --steps 160 [--check-every K]

Rank 0 prints one JSON object. Numbers are per monitored step unless named per call.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

ACC: dict[str, float] = defaultdict(float)
CNT: dict[str, int] = defaultdict(int)


def timed(owner: Any, name: str, label: str) -> None:
    """Wrap ``owner.name`` so its thread CPU time and calls accumulate under ``label``."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def inner(*a: Any, **k: Any) -> Any:
        c0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            ACC[label] += time.thread_time() - c0
            CNT[label] += 1

    setattr(owner, name, inner)


def ctx_switches() -> int:
    n = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches" in line:
                    n += int(line.split()[1])
        except OSError:
            pass
    return n


def worker(a: argparse.Namespace) -> int:  # noqa: C901, PLR0915 (one measurement flow)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from stalwart.detect import changepoint, monitor, tracking
    from stalwart.detect.monitor import Monitor
    from stalwart.train.data import load_corpus, train_batch
    from stalwart.train.model import GPT, PRESETS

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    # the parts, timed where they run (methods exist in every version of the monitor)
    timed(tracking.Tracker, "begin", "track_begin")
    timed(monitor.Monitor, "step", "monitor_step")
    timed(monitor.Monitor, "_check", "check")
    timed(changepoint.ChangeDetector, "add", "changepoint_add")
    timed(changepoint.ChangeDetector, "_best_split", "best_split")
    if hasattr(changepoint, "BOCPDBank"):  # absent before the monitor's cost was cut
        timed(changepoint.ChangeDetector, "add_many", "changepoint_add_many")
        timed(changepoint.BOCPDBank, "update", "bocpd_update")
    else:
        timed(changepoint.BOCPD, "update", "bocpd_update")
    for meth in ("_relative", "_read", "_issue", "_sample"):
        if hasattr(monitor.Monitor, meth):
            timed(monitor.Monitor, meth, meth.strip("_"))
    orig_ag = dist.all_gather

    def ag(*x: Any, **k: Any) -> Any:
        c0 = time.thread_time()
        try:
            return orig_ag(*x, **k)
        finally:
            ACC["exchange_issue"] += time.thread_time() - c0
            CNT["exchange_issue"] += 1

    work_cls = type(dist.all_reduce(torch.zeros(1), async_op=True))
    try:
        timed(work_cls, "wait", "work_wait")
    except (TypeError, AttributeError):
        pass
    mon = Monitor(run_dir=None, rank=rank, world=world, check_every=a.check_every or None)
    if a.null:
        mon.step = lambda *_a, **_k: None  # type: ignore[method-assign]
        mon.tracker.recording = False
    dist.all_gather = ag  # the monitor's own exchange (the tracker routes the rest)
    mcfg = PRESETS["tiny"]["model"]
    torch.manual_seed(0)
    model = DDP(GPT(mcfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = load_corpus(None, 2_000_000)
    pattern = (True, False, False, True)
    warm = 12
    prof = None
    if a.profile and rank == 0:
        import cProfile

        prof = cProfile.Profile(time.thread_time)
    rows: list[tuple[bool, float, float, int]] = []
    part_on: dict[str, float] = defaultdict(float)
    per_step: dict[str, list[float]] = defaultdict(list)
    calls_on: dict[str, int] = defaultdict(int)
    for step in range(warm + a.steps):
        on = step < warm or pattern[(step - warm) % 4]
        mon.enabled = on
        x, y = train_batch(corpus, a.batch, mcfg.block_size, 0, step, rank, 0)
        before = dict(ACC), dict(CNT)
        s0 = ctx_switches()
        t0, c0 = time.perf_counter(), time.process_time()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        if prof is not None and on:
            prof.enable()
        mon.step(step, {"step_time": t1 - t0, "compute_time": 0.9 * (t1 - t0),
                        "comm_time": 0.1 * (t1 - t0)})
        if prof is not None:
            prof.disable()
        t2, c2 = time.perf_counter(), time.process_time()
        s2 = ctx_switches()
        if step >= warm:
            rows.append((on, t2 - t0, c2 - c0, s2 - s0))
            if on:
                for k in ACC:
                    part_on[k] += ACC[k] - before[0].get(k, 0.0)
                    per_step[k].append(ACC[k] - before[0].get(k, 0.0))
                    calls_on[k] += CNT[k] - before[1].get(k, 0)
    mon.close()
    stats = mon.stats() if hasattr(mon, "stats") else {}
    if rank == 0:
        n_on = sum(r[0] for r in rows)
        on_cpu = [r[2] for r in rows if r[0]]
        off_cpu = [r[2] for r in rows if not r[0]]
        out = {
            "nproc": world, "steps": a.steps, "monitor_stats": stats,
            "step_wall_ms_median": {"on": 1e3 * statistics.median(r[1] for r in rows if r[0]),
                                    "off": 1e3 * statistics.median(r[1] for r in rows
                                                                   if not r[0])},
            "process_cpu_ms_median": {"on": 1e3 * statistics.median(on_cpu),
                                      "off": 1e3 * statistics.median(off_cpu)},
            "process_cpu_ms_mean": {"on": 1e3 * statistics.fmean(on_cpu),
                                    "off": 1e3 * statistics.fmean(off_cpu)},
            "ctx_switches_per_step": {
                "on": statistics.fmean(r[3] for r in rows if r[0]),
                "off": statistics.fmean(r[3] for r in rows if not r[0])},
            "us_per_monitored_step": {k: round(1e6 * v / n_on, 1) for k, v in part_on.items()},
            "us_median_per_monitored_step": {
                k: round(1e6 * statistics.median(v + [0.0] * (n_on - len(v))), 1)
                for k, v in per_step.items()},
            "calls_per_monitored_step": {k: round(v / n_on, 2) for k, v in calls_on.items()},
            "us_per_call": {k: round(1e6 * part_on[k] / calls_on[k], 1)
                            for k in part_on if calls_on[k]},
        }
        print(json.dumps(out, indent=1))
        if prof is not None:
            import pstats

            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--check-every", type=int, default=0, help="0: auto")
    ap.add_argument("--null", action="store_true",
                    help="monitor.step does nothing: the noise floor of the on/off pairing")
    ap.add_argument("--profile", action="store_true", help="rank 0: cProfile of step()")
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(a.nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *sys.argv[1:]],
                                      env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
