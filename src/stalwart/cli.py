"""The ``stalwart`` command: run, bench, report, replay, testbed. Thin: parses and calls.

Exit codes: 0 success; 1 a rank or a benchmark failed; 2 bad input (one line naming the value,
never a traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
from pathlib import Path

from stalwart.config import ConfigError, RunConfig
from stalwart.runargs import Parser, add_run_args, resolve_run_args, split_script_args


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="stalwart", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)

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
    bench.add_argument("--no-peers", action="store_true",
                       help="skip the other systems measured beside stalwart (torchft, "
                            "NVIDIA's detector); their figures are null")
    bench.add_argument("--install-peers", action="store_true",
                       help="pip-install the peers missing here first (detect: "
                            "nvidia-resiliency-ext, mitigate and elastic: torchft; pinned, "
                            "without touching torch)")

    bench.add_argument("--only", nargs="+", default=None, metavar="SCENARIO",
                       help="run only these scenarios and report their figures (mitigate: "
                            "pairlink_tp, hostlink_multi; detect: group)")

    report = sub.add_parser("report", help="(re)build a run's report.html and plots")
    report.add_argument("run_dir", type=Path)

    rp = sub.add_parser("replay", help="recorded runs through the detector and the policy, "
                                       "without training: print their decisions")
    rp.add_argument("run_dirs", type=Path, nargs="*", metavar="RUN_DIR")
    rp.add_argument("--json", type=Path, default=None, help="write the decisions here")
    rp.add_argument("--score", action="store_true",
                    help="score the decisions against each run's faults (events.jsonl)")
    from stalwart.traces import command as trace_command

    trace_command.add_args(rp)

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
    params = inspect.signature(mod.run).parameters
    if "peers" in params:
        kw["peers"] = not args.no_peers  # suites without peers have nothing to skip
    if "install_peers" in params:
        kw["install_peers"] = args.install_peers
    if "only" in params:
        bad = [o for o in args.only or [] if o not in mod.ONLY]
        if bad:
            raise ConfigError(f"--only: bench {args.suite} runs only these by themselves: "
                              f"{', '.join(mod.ONLY)} (got {' '.join(bad)})")
        kw["only"] = args.only
    elif args.only:
        raise ConfigError(f"--only {' '.join(args.only)}: bench {args.suite} runs its whole "
                          "suite only")
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


def _cmd_replay(args: argparse.Namespace) -> int:
    from stalwart.replay import main as replay

    if args.trace is not None:
        if args.run_dirs or args.score:
            raise ConfigError("--trace: give a trace or RUN_DIRs (--score), not both")
        from stalwart.traces import command as trace_command

        return trace_command.main(args)
    if not args.run_dirs:
        raise ConfigError("replay: give RUN_DIR... or --trace FILE")
    return replay(args.run_dirs, args.json, score=args.score)


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
               "replay": _cmd_replay, "testbed": _cmd_testbed,
               "simulate": _cmd_simulate}[args.cmd]
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
