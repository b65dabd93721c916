"""The options of ``stalwart run`` (also the rank entry point's, under torchrun) -> RunConfig.

One parser for both entry points, so that ``stalwart run`` and ``torchrun -m
stalwart.train.worker`` accept the same options; the result is a raw ``RunConfig`` (flat
options, defaults not yet filled): filling and checking it is ``config.resolve``'s job (one
pass, one place). Torch-free.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from stalwart.config import (
    COMM_MODES,
    CPU_CAP_MODES,
    MITIGATE_MODES,
    OVERLAP_MODES,
    TESTBEDS,
    RunConfig,
)
from stalwart.presets import PRESETS


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"stalwart: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def add_run_args(p: argparse.ArgumentParser) -> None:
    d = RunConfig().to_dict()  # the flat options' defaults
    p.add_argument("--nproc", type=int, default=d["nproc"], help="number of ranks (default 4)")
    p.add_argument("--tp", type=int, default=d["tp"], help="tensor-parallel size (default 1)")
    p.add_argument("--steps", type=int, default=d["steps"], help="optimizer steps (default 200)")
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--preset", default=d["preset"], help=f"model size: {', '.join(PRESETS)}")
    p.add_argument("--data", default=None,
                   help="text file or folder (default: this Python's standard library)")
    p.add_argument("--comm", default=d["comm"], help=f"{' | '.join(COMM_MODES)}")
    p.add_argument("--testbed", default=d["testbed"], help=f"{' | '.join(TESTBEDS)}")
    p.add_argument("--fault", action="append", default=[], dest="faults", metavar="SPEC",
                   help="KIND:key=value,... e.g. compute:rank=2,factor=2,start=20,end=60")
    p.add_argument("--mitigate", default=d["mitigate"],
                   help=f"{' | '.join(MITIGATE_MODES)}: act on stragglers (default off)")
    p.add_argument("--overlap", default=d["overlap"], help=f"{' | '.join(OVERLAP_MODES)}")
    p.add_argument("--cpu-cap", default=d["cpu_cap"],
                   help=f"{' | '.join(CPU_CAP_MODES)}: cap each testbed host at its fair share "
                        "of the cores (auto: when CPU faults are scheduled; needs root)")
    p.add_argument("--out", default=d["out"], help="folder for run directories (default runs)")
    p.add_argument("--name", default=None, help="run name (default run-DATE-TIME)")
    p.add_argument("--resume", action="store_true", help="continue --name from its checkpoint")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per rank and micro-batch at launch (sets the global batch)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--micro-batches", type=int, default=d["micro_batches"],
                   help="gradient-accumulation micro-batches per rank (default 1)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per micro-batch, the unit mitigation moves between ranks "
                        "(default: --batch-size, or a quarter of it with --mitigate)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per step over all ranks, fixed for the run (default: "
                        "batch-size x micro-batches x data-parallel ranks at the first start; "
                        "kept when a restart or an elastic torchrun job changes the world size)")
    p.add_argument("--warmup", type=int, default=d["warmup"])
    p.add_argument("--eval-every", type=int, default=d["eval_every"])
    p.add_argument("--eval-batches", type=int, default=d["eval_batches"])
    p.add_argument("--ckpt-every", type=int, default=d["ckpt_every"])
    p.add_argument("--halt-at", type=int, default=None,
                   help="stop after this step as if preempted (to try --resume)")
    p.add_argument("--mtu", type=int, default=d["mtu"], help="testbed link MTU (default 1500)")
    p.add_argument("--ranks-per-host", type=int, default=d["ranks_per_host"], metavar="K",
                   help="netns testbed: K ranks on each emulated host (rank r on host r // K); "
                        "a host's link faults slow all its ranks (default 1)")
    p.add_argument("--script", default=None, metavar="PATH",
                   help="run your own torchrun script as the ranks instead of stalwart's GPT "
                        "(its arguments after --); see docs/testbed.md")
    p.add_argument("--device", default=d["device"],
                   help="auto | cpu | cuda: where ranks compute (auto: CUDA when visible; "
                        "ranks share GPUs over gloo when there are fewer GPUs than ranks)")
    p.add_argument("--detect", dest="detect", action="store_const", const=True, default=None,
                   help="run the straggler monitor (default: on for stalwart's workload; a "
                        "--script run gets it only when asked, without changing the script)")
    p.add_argument("--no-detect", dest="detect", action="store_const", const=False,
                   help="do not run the straggler monitor")
    p.add_argument("--threads", type=int, default=d["threads"], help="torch threads per rank")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")


def resolve_run_args(args: dict, script_args: list[str] | None = None) -> dict:
    """Parsed run options -> RunConfig's flat options: arguments after -- go to the script
    (whether the monitor runs, when neither --detect nor --no-detect is given, is
    ``resolve``'s default: on for stalwart's workload, off for a script)."""
    args["script_args"] = list(script_args or [])
    return args


def split_script_args(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """`run ... -- A B` -> (`run ...`, [A, B]); (argv, None) without `--`."""
    if "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def config_from_run_args(argv: list[str]) -> RunConfig:
    p = Parser(prog="stalwart run")
    add_run_args(p)
    argv, script_args = split_script_args(argv)
    args = vars(p.parse_args(argv))
    args.pop("no_progress")
    return RunConfig(**resolve_run_args(args, script_args))
