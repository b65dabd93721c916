"""Rank 0's CPU time inside ``monitor.step``: a by-hand measurement script (not a test).

``overhead``: the benchmark's own overhead job (``stalwart bench detect``'s
``measure_overhead``: 4 gloo ranks, the tiny GPT, the monitor on and off in ABBA order), run
``--repeat`` times; prints each run's ``monitor_step_cpu_us_median`` (the figure
``monitor_step_cpu_us``: rank 0's CPU per monitored step, its training thread inside
``monitor.step`` plus its analysis thread, amortised), the training thread's alone, the
analysis thread's per step, and the process-CPU overhead. ``--phases-dir DIR``: every rank's
monitor phases timed (thread CPU per call, by thread) into DIR/rankR-phases.json;
``--profile-dir DIR``: cProfile of the same into DIR/rankR-*.pstats. Compare two commits in
one session, alternating, on a machine this loaded: the figure moves by 1.5x with the load of
other jobs.

``cold``: one process, no torch.distributed: a rank-0 ``Monitor`` fed step hints and an
exchange whose rows come from a stand-in link (no sockets; the other ranks' compute drawn
around rank 0's, rank 2 2x slow from step 250 unless ``--clean``), with a training step's
worth of other work (three 384x384 matmuls, a 4M-element numpy update) between steps so the
caches are as cold as in training; prints the median thread CPU per ``monitor.step`` and
the analysis thread's CPU per check it took (rank 0 analyses there: monitor.py ``_check``).
``--profile`` prints cProfile's top functions by own time.

    python tests/detect/step_cost.py overhead --steps 200 --repeat 3
    python tests/detect/step_cost.py cold [--clean] [--warm] [--profile] [--check-every 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class _Rows:
    """A stand-in row link for rank 0: its own row back, and the other ranks' rows made
    from it (their compute = rank 0's x lognormal noise; rank 2 x2 from ``slow_from``)."""

    def __init__(self, world: int, slow_from: int) -> None:
        import numpy as np

        self.world, self.slow_from = world, slow_from
        self.rng = np.random.default_rng(1)
        self.own: dict[int, list[float]] = {}

    def issue(self, seq: int, row: list[float]) -> None:
        self.own[seq] = list(row)

    def wait(self, seq: int) -> None:
        pass

    def read(self, seq: int) -> list[list[float]]:
        own = self.own.pop(seq)
        rows, n = [own], int(own[4])
        for r in range(1, self.world):
            row = [0.0, 0.0, 0.0, -1.0, float(n), 1.0] + [0.0] * (len(own) - 6)
            for j in range(n):
                key, c = own[6 + 2 * j], own[7 + 2 * j] * float(
                    self.rng.lognormal(0.0, 0.08))
                row[6 + 2 * j], row[7 + 2 * j] = key, c * (2.0 if r == 2 and key >=
                                                           self.slow_from else 1.0)
            rows.append(row)
        return rows

    def close(self) -> None:
        pass


def cold(a: argparse.Namespace) -> None:
    import cProfile
    import pstats

    import numpy as np
    import torch

    from stalwart.detect.exchange import Exchange
    from stalwart.detect.monitor import Monitor, amortised

    torch.set_num_threads(1)
    write = None
    if a.phases_dir:
        import os

        from stalwart.bench.detect_overhead import PHASES_ENV, _phase_timer

        Path(a.phases_dir).mkdir(parents=True, exist_ok=True)
        os.environ[PHASES_ENV] = str(Path(a.phases_dir).resolve())
        write = _phase_timer(0)
    if a.profile_dir:
        import os

        from stalwart.bench.detect_overhead import PROFILE_ENV, _profiler

        Path(a.profile_dir).mkdir(parents=True, exist_ok=True)
        os.environ[PROFILE_ENV] = str(Path(a.profile_dir).resolve())
        _profiler(0)  # (the analysis thread's jobs, written at exit)
    rng = np.random.default_rng(0)
    mon = Monitor(run_dir=None, rank=0, world=1, validate_on_detect=False)
    rows: Any = _Rows(4, 10 ** 9 if a.clean else 250)
    every = a.check_every or None
    mon.exchange = Exchange(0, rows, mon.core, check_every=every,
                            max_every=a.check_every or 1, lag=1)
    m, big = torch.randn(384, 384), np.zeros(4_000_000)
    prof = cProfile.Profile(time.thread_time) if a.profile else None
    ts = []
    for k in range(a.steps):
        if not a.warm:
            for _ in range(3):
                m @ m
            big += 1.0
        st = float(np.exp(rng.normal(np.log(0.08), 0.09)))
        if prof is not None and k >= 50:
            prof.enable()
        c0 = time.thread_time()
        mon.step(k, {"step_time": st, "compute_time": 0.9 * st, "comm_time": 0.1 * st})
        ts.append(time.thread_time() - c0)
        if prof is not None:
            prof.disable()
    ts = ts[50:]
    found = [(f.kind, f.step) for f in mon.core.findings]
    am = amortised(ts)
    st = mon.stats()
    print(f"{'warm' if a.warm else 'cold'} (exchange every {a.check_every or 1}): "
          f"monitor.step median {1e6 * statistics.median(ts):.1f} us, amortised "
          f"{1e6 * statistics.median(am):.1f} us, mean {1e6 * statistics.fmean(ts):.1f} us "
          f"thread CPU over {len(ts)} steps; analysis thread "
          f"{st.get('monitor_analysis_cpu_us_median')} us per check "
          f"({st.get('analysed_off_thread')} checks); verdicts {found}")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if write is not None:
        write({"steps": a.steps, "checks": st.get("checks"),
               "analysed_off_thread": st.get("analysed_off_thread")})


def overhead(a: argparse.Namespace) -> None:
    import os

    from stalwart.bench.detect import measure_overhead
    from stalwart.bench.detect_overhead import PHASES_ENV, PROFILE_ENV

    if a.profile_dir:
        Path(a.profile_dir).mkdir(parents=True, exist_ok=True)
        os.environ[PROFILE_ENV] = str(Path(a.profile_dir).resolve())
    if a.phases_dir:
        Path(a.phases_dir).mkdir(parents=True, exist_ok=True)
        os.environ[PHASES_ENV] = str(Path(a.phases_dir).resolve())
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.repeat):
            ov = measure_overhead(Path(d), f"r{i}", a.steps)
            mon = ov.get("monitor") or {}
            print(json.dumps({**{k: ov.get(k) for k in (
                "monitor_step_cpu_us_median", "monitor_step_cpu_us_mean",
                "monitor_step_cpu_us_training_thread", "monitor_analysis_cpu_us_per_step",
                "monitor_step_cpu_us_quantiles", "cpu_overhead", "cpu_ci95", "overhead",
                "ci95", "error")}, **{k: mon.get(k) for k in (
                    "monitor_check_cpu_us_median", "monitor_analysis_cpu_us_median")}}),
                  flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("overhead", "cold"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--clean", action="store_true")
    ap.add_argument("--check-every", type=int, default=0,
                    help="cold: a fixed exchange period (0: one exchange per step)")
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--phases-dir", default="",
                    help="overhead (cold: rank 0 alone): every rank's monitor phases timed "
                         "(thread CPU per call) into DIR/rank*-phases.json")
    ap.add_argument("--profile-dir", default="",
                    help="overhead: every rank's monitor.step and rank 0's analysis jobs "
                         "profiled (cProfile, thread CPU) into DIR/rank*-*.pstats")
    a = ap.parse_args()
    (cold if a.what == "cold" else overhead)(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
