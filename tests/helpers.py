"""Helpers shared by tests that drive the real `stalwart` command in subprocesses."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.launch import free_port

__all__ = ["FAST", "SRC", "free_port", "spawn_ranks", "stalwart"]

SRC = Path(__file__).resolve().parents[1] / "src"


def stalwart(*args: str, timeout: float = 300, cwd: Path | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m stalwart.cli ARGS` and capture its output (never hangs past timeout)."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = str(SRC) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "stalwart.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=full_env)


# small, fast runs: a few seconds each on 2 cores
FAST = ["--steps", "12", "--eval-every", "6", "--ckpt-every", "6", "--eval-batches", "2",
        "--no-progress"]


def spawn_ranks(target: Callable[..., None], world: int, *args: Any,
                timeout: float = 60) -> dict[int, Any]:
    """Run ``target(rank, world, *args, out)`` in ``world`` spawned processes; each puts one
    ``(rank, result)`` on ``out``. Returns {rank: result}; a process still alive after its
    result (or the timeout) is killed, so a hung rank never hangs the test."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
