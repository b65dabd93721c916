"""No leftovers: after close(), after an owner killed with -9 plus cleanup_stale(), and never
touching a live owner's resources."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.config import RunConfig
from stalwart.rundir import EventLog, read_jsonl
from stalwart.testbed import Hosts, cleanup_stale, open_testbed
from stalwart.testbed.cleanup import list_links, list_netns, owned_by

pytestmark = pytest.mark.root

FAULTS = ["loss:host=all,p=0.05", "link:host=0,rate=40mbit", "pairlink:hosts=0-1,rate=20mbit",
          "compute:rank=1,factor=2", "contention:rank=0,procs=1"]


def _nothing(found: dict[str, list[str]]) -> bool:
    return not any(found.values())


def test_close_removes_everything(tmp_path: Path) -> None:
    cfg = RunConfig(nproc=2, testbed="netns", faults=FAULTS).validate()
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                               stdin=subprocess.PIPE)
    def cpu_cgroup() -> str:
        with open(f"/proc/{sleeper.pid}/cgroup") as f:
            return [ln for ln in f if ":cpu:" in ln or ln.startswith("0::")][0]

    try:
        origin = cpu_cgroup()
        tb = open_testbed(cfg, EventLog(tmp_path))
        with tb:
            tb.attach_ranks({0: sleeper.pid, 1: sleeper.pid})
            tb.on_step(0)
            names = [tb.hosts.ns(i) for i in range(2)]
            links = [tb.hosts.bridge, tb.hosts.port(0), tb.hosts.port(1)]
            groups = [g.path for g in tb._groups.values()]
            assert set(names) <= set(list_netns()) and set(links) <= set(list_links())
            assert len(groups) == 2 and all(g.exists() for g in groups)
        tb.close()  # idempotent
        # the process we throttled is back in the cgroup it came from
        assert cpu_cgroup() == origin
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not set(names) & set(list_netns())
    assert not set(links) & set(list_links())
    assert not any(g.exists() for g in groups)


_OWNER = r"""
import sys
from pathlib import Path
from stalwart.config import RunConfig
from stalwart.rundir import EventLog, read_jsonl
from stalwart.testbed import open_testbed
faults = sys.argv[2:]
cfg = RunConfig(nproc=2, testbed="netns", faults=faults).validate()
tb = open_testbed(cfg, EventLog(Path(sys.argv[1])))
import os
tb.attach_ranks({0: os.getpid(), 1: os.getpid()})
tb.on_step(0)
print("ready", flush=True)
sys.stdin.read()
"""


def test_killed_owner_leaves_only_stale_resources_that_cleanup_removes(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path), *FAULTS],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "ready"
        left = owned_by(owner.pid)
        assert len(left["netns"]) == 2 and len(left["cgroups"]) == 2 and left["links"]
        # while the owner lives, a cleanup by someone else leaves its testbed alone
        cleanup_stale()
        assert owned_by(owner.pid) == left
    finally:
        owner.kill()
        owner.wait()
    assert not _nothing(owned_by(owner.pid))  # -9: nothing could clean up
    removed = cleanup_stale()
    assert removed and _nothing(owned_by(owner.pid))


def test_a_new_start_removes_stale_leftovers_but_not_live_ones(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    assert owner.stdout.readline().strip() == "ready"
    owner.kill()
    owner.wait()
    assert owned_by(owner.pid)["netns"]
    with Hosts(1) as live:
        assert _nothing(owned_by(owner.pid))  # the next start cleaned up
        with Hosts(1) as second:  # and a second start keeps the first (live) one
            assert live.ns(0) in list_netns() and second.ns(0) in list_netns()
    assert _nothing(owned_by(owner.pid))


def test_sigterm_closes_the_testbed(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path), *FAULTS],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    assert owner.stdout.readline().strip() == "ready"
    assert owned_by(owner.pid)["netns"]
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=60) == -signal.SIGTERM  # the default action still happens
    assert _nothing(owned_by(owner.pid))  # without any stale cleanup
    removed = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "fault_removed"]
    assert len(removed) == len(FAULTS) and all(e["at_close"] for e in removed)
