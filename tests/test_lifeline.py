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


def test_the_launcher_starts_ranks_through_lifeline_without_preexec_fn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the launcher runs threads (rich's live display) while it starts ranks: a preexec_fn runs
    # Python in the forked child before exec, where a lock another thread held at fork time
    # stays held for ever. Every rank must start by a plain exec (start_new_session only), and
    # tie itself to the launcher after exec through stalwart.lifeline.
    from types import SimpleNamespace

    from stalwart import launch
    from stalwart.rundir import LOGS

    calls: list[tuple[list[str], dict]] = []

    class FakePopen:
        def __init__(self, cmd: list[str], **kw: object) -> None:
            calls.append((cmd, kw))
            self.pid = 10_000 + len(calls)

    attached: dict[int, int] = {}
    tb = SimpleNamespace(kind="local", master_addr="127.0.0.1",
                         env=lambda r: {}, command_prefix=lambda r: [],
                         attach_ranks=attached.update)
    cfg = SimpleNamespace(job=SimpleNamespace(nproc=3, script=None, threads=1),
                          testbed=SimpleNamespace(ranks_per_host=1))
    (tmp_path / LOGS).mkdir()
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    procs = launch._spawn(cfg, tb, tmp_path, "stalwart.train.worker", None, port=29500)
    assert sorted(procs) == [0, 1, 2] and len(attached) == 3
    for cmd, kw in calls:
        assert "preexec_fn" not in kw or kw["preexec_fn"] is None, kw
        assert kw.get("start_new_session") is True
        i = cmd.index("-m")
        assert cmd[i + 1:i + 4] == ["stalwart.lifeline", str(os.getpid()),
                                    "stalwart.train.worker"]
