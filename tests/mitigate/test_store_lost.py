"""The membership store process of a job that regroups in place dies (elastic/runlink.py):
the launcher must stop the job at once with one line naming the store and its log -- not
train on unable to announce a generation, and not hang. Real processes on the local
testbed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.rundir import RunData

pytestmark = pytest.mark.slow


def _store_pid(launcher: int) -> int | None:
    """The launcher's store process (lifeline's first argument is the launcher's pid)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "stalwart.elastic.store" in cmd and str(launcher) in cmd:
            return int(pid)
    return None


def test_the_store_process_dying_stops_the_job_with_one_line(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "stalwart.cli", "run", "--nproc", "2", "--mitigate", "auto",
           "--steps", "100000", "--eval-every", "100000", "--ckpt-every", "100000",
           "--no-progress", "--out", str(tmp_path), "--name", "sl"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "sl" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not (
                metrics.exists() and metrics.stat().st_size > 0):
            time.sleep(0.2)  # training: the ranks have read their first generation
        pid = _store_pid(proc.pid)
        assert pid is not None and proc.poll() is None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    assert "membership store process exited" in out and "elastic-store.log" in out, out
    run = RunData.load(tmp_path / "sl")
    lost = run.events_of("store_lost")
    assert len(lost) == 1 and "exit code -9" in lost[0]["error"], lost
    assert run.events_of("run_finished")[-1]["ok"] is False
    # its next poll (0.1 s) and stopping the ranks (SIGTERM, at most GRACE_S = 3 s)
    assert took < 30, took
