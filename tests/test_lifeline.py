"""Ranks die with their launcher (stalwart.lifeline), set up after exec, not in a preexec_fn."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_rank_dies_when_its_launcher_is_killed(tmp_path: Path) -> None:
    (tmp_path / "sleeper.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    parent = textwrap.dedent(f"""
        import os, subprocess, sys
        env = {{**os.environ, "PYTHONPATH": {str(tmp_path)!r} + os.pathsep +
               os.environ.get("PYTHONPATH", "")}}
        child = subprocess.Popen([sys.executable, "-m", "stalwart.lifeline", str(os.getpid()),
                                  "sleeper"], env=env, start_new_session=True)
        print(child.pid, flush=True)
        child.wait()
    """)
    p = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        child = int(p.stdout.readline())
        time.sleep(1.0)  # the child has tied itself to the parent
        assert _alive(child)
        p.send_signal(signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        p.kill()


def test_a_rank_whose_launcher_is_already_gone_exits() -> None:
    r = subprocess.run([sys.executable, "-m", "stalwart.lifeline", str(os.getpid() + 999_999),
                        "stalwart.cli", "--help"], capture_output=True, timeout=60)
    assert r.returncode == 1 and not r.stdout
