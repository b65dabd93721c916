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

__all__ = ["FAST", "SRC", "free_port", "goes_on_after_its_last_completed_step", "spawn_ranks",
           "stalwart"]

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


def goes_on_after_its_last_completed_step(run: Any, back: int, world: int,
                                          hosts: set[int]) -> None:
    """After a rank is killed, the survivors (``hosts``) go on -- in place or relaunched --
    at the step after the last one they completed in the old ``world`` (``back``): nothing
    they completed is redone, nothing is skipped, at most the step in flight is redone.
    Measured against their own metrics (``run``: a RunData), not the kill's scheduled step:
    the launcher applies a kill when it reads that step's metrics (every 0.1 s), when the
    ranks may be a few 20 ms steps further on (CI runs: scheduled at 6, back at 9)."""
    done = max(m["step"] for m in run.metrics if m["world"] == world and m["host"] in hosts)
    assert back == done + 1, (back, done)
    assert back >= 6  # not before the kill (every caller schedules it at step 6)
