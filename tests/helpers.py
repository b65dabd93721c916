"""Helpers shared by tests that drive the real `stalwart` command in subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
