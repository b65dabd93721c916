"""The testbed under the real launcher: scheduled faults appear and disappear at their steps in
events.jsonl, and nothing is left behind -- after a clean run and after a launcher killed -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.rundir import read_jsonl
from stalwart.testbed import Hosts
from stalwart.testbed.cleanup import owned_by

pytestmark = [pytest.mark.root, pytest.mark.slow]

SRC = Path(__file__).resolve().parents[2] / "src"
SHORT = ["--eval-every", "1000", "--eval-batches", "1", "--ckpt-every", "1000", "--no-progress"]


def _launcher(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "stalwart.cli", "run", *args, *SHORT],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _faults(run_dir: Path) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"].startswith("fault_")]


def test_scheduled_faults_appear_and_disappear_at_their_steps(tmp_path: Path) -> None:
    p = _launcher("--testbed", "netns", "--nproc", "2", "--steps", "30",
                  "--fault", "loss:host=all,p=0.05",
                  "--fault", "compute:rank=1,factor=2,start=5,end=15",
                  "--out", str(tmp_path), "--name", "t")
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out
    got = [(e["event"], e["kind"], e["step"], e.get("rank"), e.get("hosts"))
           for e in _faults(tmp_path / "t")]
    assert got == [
        ("fault_applied", "loss", 0, None, [0, 1]),
        ("fault_applied", "compute", 5, 1, None),
        ("fault_removed", "compute", 15, 1, None),
        ("fault_removed", "loss", 30, None, [0, 1]),
    ]
    for e in _faults(tmp_path / "t"):
        assert e["time"] > 0 and e["mechanism"] and e["magnitude"] in (0.05, 2.0)
        assert e["target"] in ("all", "rank1")
    assert not any(owned_by(p.pid).values()), owned_by(p.pid)


def test_killed_launcher_leaves_nothing_after_the_next_start(tmp_path: Path) -> None:
    p = _launcher("--testbed", "netns", "--nproc", "2", "--steps", "100000",
                  "--fault", "loss:host=1,p=0.02", "--fault", "link:host=0,rate=200mbit",
                  "--fault", "contention:rank=0,procs=1,start=2",
                  "--out", str(tmp_path), "--name", "k")
    try:
        deadline = time.monotonic() + 120
        while not any(e["kind"] == "contention" for e in _faults(tmp_path / "k")):
            assert p.poll() is None, p.communicate()[0]
            assert time.monotonic() < deadline, "contention fault never applied"
            time.sleep(0.2)
        assert owned_by(p.pid)["netns"] and owned_by(p.pid)["cgroups"]
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate()
    with Hosts(1):  # the next start removes what the killed launcher left
        assert not any(owned_by(p.pid).values()), owned_by(p.pid)
    events = [json.loads(x) for x in (tmp_path / "k" / "events.jsonl").read_text().splitlines()]
    assert not any(e["event"] == "fault_removed" for e in events)  # -9: nobody could log it
