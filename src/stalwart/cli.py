"""The ``stalwart`` command: run, bench, report, testbed. Thin: parses, calls, maps errors.

Exit codes: 0 success; 1 a rank or a benchmark failed; 2 bad input (one line naming the value,
never a traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
from pathlib import Path
from typing import NoReturn

from stalwart.config import (
    COMM_MODES,
    CPU_CAP_MODES,
    MITIGATE_MODES,
    OVERLAP_MODES,
    TESTBEDS,
    ConfigError,
    RunConfig,
)
from stalwart.train.model import PRESETS


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"stalwart: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def add_run_args(p: argparse.ArgumentParser) -> None:
    d = RunConfig()
    p.add_argument("--nproc", type=int, default=d.nproc, help="number of ranks (default 4)")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size (default 1)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default 200)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--preset", default=d.preset, help=f"model size: {', '.join(PRESETS)}")
    p.add_argument("--data", default=None,
                   help="text file or folder (default: this Python's standard library)")
    p.add_argument("--comm", default=d.comm, help=f"{' | '.join(COMM_MODES)}")
    p.add_argument("--testbed", default=d.testbed, help=f"{' | '.join(TESTBEDS)}")
    p.add_argument("--fault", action="append", default=[], dest="faults", metavar="SPEC",
                   help="KIND:key=value,... e.g. compute:rank=2,factor=2,start=20,end=60")
    p.add_argument("--mitigate", default=d.mitigate,
                   help=f"{' | '.join(MITIGATE_MODES)}: act on stragglers (default off)")
    p.add_argument("--overlap", default=d.overlap, help=f"{' | '.join(OVERLAP_MODES)}")
    p.add_argument("--cpu-cap", default=d.cpu_cap,
                   help=f"{' | '.join(CPU_CAP_MODES)}: cap each testbed host at its fair share "
                        "of the cores (auto: when CPU faults are scheduled; needs root)")
    p.add_argument("--out", default=d.out, help="folder for run directories (default runs)")
    p.add_argument("--name", default=None, help="run name (default run-DATE-TIME)")
    p.add_argument("--resume", action="store_true", help="continue --name from its checkpoint")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per rank and micro-batch at launch (sets the global batch)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches,
                   help="gradient-accumulation micro-batches per rank (default 1)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per micro-batch, the unit mitigation moves between ranks "
                        "(default: --batch-size, or a quarter of it with --mitigate)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per step over all ranks, fixed for the run (default: "
                        "batch-size x micro-batches x data-parallel ranks at the first start; "
                        "kept when a restart or an elastic torchrun job changes the world size)")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    p.add_argument("--halt-at", type=int, default=None,
                   help="stop after this step as if preempted (to try --resume)")
    p.add_argument("--mtu", type=int, default=d.mtu, help="testbed link MTU (default 1500)")
    p.add_argument("--script", default=None, metavar="PATH",
                   help="run your own torchrun script as the ranks instead of stalwart's GPT "
                        "(its arguments after --); see docs/testbed.md")
    p.add_argument("--device", default=d.device,
                   help="auto | cpu | cuda: where ranks compute (auto: CUDA when visible; "
                        "ranks share GPUs over gloo when there are fewer GPUs than ranks)")
    p.add_argument("--detect", dest="detect", action="store_const", const=True, default=None,
                   help="run the straggler monitor (default: on for stalwart's workload; a "
                        "--script run gets it only when asked, without changing the script)")
    p.add_argument("--no-detect", dest="detect", action="store_const", const=False,
                   help="do not run the straggler monitor")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")


def resolve_run_args(args: dict, script_args: list[str] | None = None) -> dict:
    """Parsed run options -> RunConfig fields: the monitor's default depends on the workload
    (a user's script gets it only with --detect), arguments after -- go to the script."""
    if args.get("detect") is None:
        args["detect"] = args.get("script") is None
    args["script_args"] = list(script_args or [])
    return args


def split_script_args(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """`run ... -- A B` -> (`run ...`, [A, B]); (argv, None) without `--`."""
    if "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def config_from_run_args(argv: list[str]) -> RunConfig:
    p = _Parser(prog="stalwart run")
    add_run_args(p)
    argv, script_args = split_script_args(argv)
    args = vars(p.parse_args(argv))
    args.pop("no_progress")
    return RunConfig(**resolve_run_args(args, script_args))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="stalwart", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="train the reference GPT (or run your own script: "
                                     "--script PATH -- ARGS) on N ranks",
                         usage="stalwart run [options] [--script PATH [-- SCRIPT ARGS]]")
    add_run_args(run)

    bench = sub.add_parser("bench", help="run a benchmark suite")
    from stalwart.bench import SUITES

    bench.add_argument("suite", choices=SUITES)
    bench.add_argument("--quick", action="store_true", help="a few minutes on 2 cores")
    bench.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"),
                       help="where the ranks compute (overlap only; default cpu)")
    bench.add_argument("--json", type=Path, default=None, help="write the figures here")
    bench.add_argument("--workdir", type=Path, default=Path("runs/bench"),
                       help="each invocation's runs go to a new folder under it "
                            "(default runs/bench)")

    report = sub.add_parser("report", help="(re)build a run's report.html and plots")
    report.add_argument("run_dir", type=Path)

    tb = sub.add_parser("testbed", help="emulated hosts: check what works, clean up")
    tb.add_argument("action", choices=("check", "cleanup"))

    from stalwart.simulate import command as sim_command

    sim = sub.add_parser("simulate", help="trace-driven simulation at 1k-10k+ ranks that "
                                          "runs the real detector, planner and policy")
    sim_command.add_args(sim)
    return p


def _cmd_run(args: argparse.Namespace, script_args: list[str] | None = None) -> int:
    from stalwart.launch import launch

    show = not args.__dict__.pop("no_progress")
    args.__dict__.pop("cmd")
    cfg = RunConfig(**resolve_run_args(vars(args), script_args))
    return launch(cfg, show_progress=show)


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib
    import inspect
    import shlex

    from rich.console import Console
    from rich.table import Table

    from stalwart.bench import fresh_workdir, save

    mod = importlib.import_module(f"stalwart.bench.{args.suite}")
    kw = {}
    if "device" in inspect.signature(mod.run).parameters:
        from stalwart.devices import DeviceError, check_request

        try:
            check_request(args.device, 2)  # a one-line error before any folder is made
        except DeviceError as e:
            raise ConfigError(str(e)) from None
        kw["device"] = args.device
    elif args.device == "cuda":
        raise ConfigError(f"bench {args.suite} runs on CPU only (--device cuda: use bench "
                          f"overlap, or stalwart run --device cuda)")
    workdir = fresh_workdir(args.workdir, args.suite)  # every invocation starts clean
    print(f"work folder: {workdir}")
    result = mod.run(quick=args.quick, workdir=workdir, **kw)
    result.command = "stalwart " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    table = Table(title=f"stalwart bench {args.suite}{' --quick' if args.quick else ''}")
    for col in ("figure", "value", "target", "verdict"):
        table.add_column(col)
    for row in result.table_rows():
        table.add_row(*row)
    Console().print(table)
    if args.json:
        save(result, args.json)
        print(f"figures written to {args.json}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from stalwart.report import build_report

    if not args.run_dir.is_dir():
        raise ConfigError(f"not a run directory: {args.run_dir}")
    print(build_report(args.run_dir))
    return 0


def _cmd_testbed(args: argparse.Namespace) -> int:
    from stalwart.testbed import check

    if args.action == "check":
        rows = check.run_check()
        check.print_check(rows)
        return 0
    from stalwart.testbed import cleanup_stale

    removed = cleanup_stale()
    print(f"removed {len(removed) if removed else 0} leftover testbed resources")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from stalwart.simulate import command as sim_command

    try:
        return sim_command.main(args)
    except ValueError as e:  # bad input: one line naming the value
        raise ConfigError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    # `kill -USR1 <pid>` prints every thread's stack to stderr: how to see where a launcher
    # that does not stop is waiting
    if hasattr(signal, "SIGUSR1"):
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (ValueError, OSError):  # stderr without a file descriptor (called in-process)
            pass
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = None
    if argv[:1] == ["run"]:
        # everything after `--` belongs to the user's script, never to argparse
        argv, script_args = split_script_args(argv)
    args = build_parser().parse_args(argv)
    handler = {"run": _cmd_run, "bench": _cmd_bench, "report": _cmd_report,
               "testbed": _cmd_testbed, "simulate": _cmd_simulate}[args.cmd]
    try:
        if args.cmd == "run":
            return _cmd_run(args, script_args)
        return handler(args)
    except ConfigError as e:
        print(f"stalwart: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stalwart: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
