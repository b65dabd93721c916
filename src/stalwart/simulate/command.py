"""Options of ``stalwart simulate`` and their checks (cli.py only wires them in).

Bad input raises ``ValueError`` with one line naming the value; cli.py turns it into exit
code 2 without a traceback.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys

from stalwart.simulate.run import Options, simulate
from stalwart.simulate.scenarios import POLICIES, scale_job


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", default="10000",
                   help="GPUs (ranks), or a comma-separated list: one set of scenarios each "
                        "(default 10000; a multiple of tp x pp)")
    p.add_argument("--hours", type=float, default=24.0,
                   help="healthy job length in simulated hours (default 24)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"scenarios besides the healthy one (default {','.join(POLICIES)})")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default 8)")
    p.add_argument("--pp", type=int, default=5, help="pipeline stages (default 5)")
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--noise-scale", type=float, default=0.25,
                   help="multiplies the log-noise measured on the testbed (default 0.25: its "
                        "4 CPU ranks on 2 shared cores vary ~16%% per rank and step, a GPU "
                        "fleet ~4%%; 1 = as measured)")
    p.add_argument("--restart-s", type=float, default=12.0,
                   help="seconds a restart (regroup) costs (default 12: BENCHMARKS mitigate)")
    p.add_argument("--validation-s", type=float, default=1.0,
                   help="seconds a validation pause costs (default 1: BENCHMARKS detect)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault", action="append", default=[], dest="faults", metavar="SPEC",
                   help="scripted fault instead of FALCON-drawn ones: compute:rank=R,factor=F"
                        " | link:host=H,factor=F | stop:host=H, with start=/end= (steps, or "
                        "seconds with an s)")
    p.add_argument("--events", type=int, default=0,
                   help="exactly this many FALCON-drawn fail-slows within --hours (FALCON's "
                        "end-to-end protocol: 12 over one job) instead of the per-GPU-hour rate")
    p.add_argument("--cost-ranks", default="",
                   help="comma-separated rank counts for the decision-cost sweep (before and "
                        "after the scale fixes); empty: no sweep")
    p.add_argument("--cost-steps", type=int, default=150)
    p.add_argument("--calibrate", nargs="*", default=[], metavar="RUN_DIR",
                   help="recorded testbed runs to calibrate against (default: the summaries "
                        "kept in the package)")
    p.add_argument("--out", default="runs")
    p.add_argument("--name", default=None)
    p.add_argument("--json", default=None, help="write the figures here too")
    p.add_argument("--no-progress", action="store_true")


def _ints(text: str, what: str) -> list[int]:
    out = []
    for part in filter(None, text.split(",")):
        try:
            out.append(int(part))
        except ValueError:
            raise ValueError(f"{what}: not an integer: {part!r}") from None
    return out


def options(a: argparse.Namespace) -> Options:
    ranks = _ints(a.ranks, "--ranks")
    if not ranks:
        raise ValueError("--ranks: need at least one rank count")
    for name, v in (("--hours", a.hours), ("--restart-s", a.restart_s),
                    ("--validation-s", a.validation_s)):
        if not math.isfinite(v) or v < 0 or (name == "--hours" and v <= 0):
            raise ValueError(f"{name} must be a positive number, got {v}")
    if not math.isfinite(a.noise_scale) or a.noise_scale < 0:
        raise ValueError(f"--noise-scale must be >= 0, got {a.noise_scale}")
    pols = tuple(filter(None, a.policies.split(",")))
    for p in pols:
        if p not in POLICIES:
            raise ValueError(f"--policies: unknown policy {p!r} (one of {', '.join(POLICIES)})")
    if a.events < 0:
        raise ValueError(f"--events must be >= 0, got {a.events}")
    if a.cost_steps < 20:
        raise ValueError(f"--cost-steps must be >= 20, got {a.cost_steps}")
    opts = Options(ranks=ranks, hours=a.hours, policies=pols, tp=a.tp, pp=a.pp,
                   gpus_per_host=a.gpus_per_host, noise_scale=a.noise_scale,
                   restart_s=a.restart_s, validation_s=a.validation_s, seed=a.seed,
                   faults=list(a.faults), events=a.events,
                   cost_ranks=_ints(a.cost_ranks, "--cost-ranks"),
                   cost_steps=a.cost_steps, calibrate_dirs=list(a.calibrate), out=a.out,
                   name=a.name, json=a.json, progress=not a.no_progress)
    from stalwart.simulate.faults import parse

    for n in [*ranks, *opts.cost_ranks]:
        job = scale_job(n, a.tp, a.pp, a.gpus_per_host)  # raises on a bad shape
        for spec in opts.faults:
            parse(spec, job.ranks, job.hosts, 1.0)  # raises on a bad spec, before any work
    return opts


def main(a: argparse.Namespace) -> int:
    opts = options(a)
    command = "stalwart " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    run_dir, figures = simulate(opts, command)
    for k in ("sim_step_error", "planner_ms_10k_groups", "sim_wall_s", "sim_cpu_s",
              "decision_us_per_rank_step"):
        print(f"{k}: {figures.get(k)}")
    for n in opts.ranks:
        from stalwart.simulate.scenarios import scale_tag

        tag = scale_tag(n)
        keys = [k for k in figures if k.endswith(f"_{tag}") and (
            k.startswith(("jct_", "decision_ms_per_step", "decision_us_per_rank_step",
                          "false_alarms", "detection",
                          "pauses_per_day", "sim_wall_s_" + tag)))]
        for k in keys:
            print(f"{k}: {figures[k]}")
    print(f"report: {run_dir / 'report.html'}")
    return 0
