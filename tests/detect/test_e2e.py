"""End to end: `stalwart run --testbed netns` with real kernel faults, verdicts in events.jsonl.

One run covers the issue's acceptance checks: a compute straggler on rank 3 (cgroup CPU quota,
factor 2 from step 40) is reported as compute on rank 3 with its onset within 5 steps of 40,
and a slow host link (tc tbf) injected later is reported as a link, not as a rank's compute.
The micro-batch is raised to 32 so that a step is compute-bound enough for the quota to show
on a 2-core machine that other jobs load too. (The factor was 1.5 while the testbed left
healthy ranks uncapped: that 1.5 slowed the rank ~2x. With every host held at its fair share
a factor now means itself, and 1.5x sits on the detector's 1.5x confirmation line -- a
separate, open question (issue 13) -- so the test keeps the ~2x it always exercised.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.rundir import RunData


@pytest.mark.slow
@pytest.mark.root
def test_compute_then_link_fault_are_found_and_told_apart(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "stalwart.cli", "run", "--testbed", "netns", "--nproc", "4",
           "--fault", "compute:rank=3,factor=2,start=40,end=70",
           "--fault", "link:host=1,rate=30mbit,start=90",
           "--steps", "120", "--batch-size", "32", "--out", str(tmp_path), "--name", "e2e",
           "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    run = RunData.load(tmp_path / "e2e")
    found = run.events_of("straggler_detected")
    assert found, "no straggler detected"
    comp = [e for e in found if 35 <= e["onset_step"] < 70]
    assert comp, found
    assert comp[0]["kind"] == "compute" and comp[0]["ranks"] == [3], comp[0]
    assert abs(comp[0]["onset_step"] - 40) <= 5
    link = [e for e in found if e["onset_step"] >= 87]
    assert link, found
    assert link[0]["kind"] == "link", link[0]
    assert 1 in link[0]["link"] or link[0]["ranks"] == [1]


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.parametrize("fault,kind,ranks,link,batch", [
    ("compute:rank=2,factor=2", "compute", [2], None, 1024),
    ("link:host=1,rate=30mbit", "link", [1], None, 256),
    ("pairlink:hosts=1-2,rate=20mbit", "link", [], [1, 2], 256),
], ids=["compute2x", "hostlink", "pairlink"])
def test_stragglers_present_from_the_start_of_a_users_script_are_found(
        tmp_path: Path, fault: str, kind: str, ranks: list[int], link: list[int] | None,
        batch: int) -> None:
    """Issue 24: a plain DDP script (no stalwart import), a fault present from step 0 -- no
    change point exists; the outlier test or the audit names it, since the first sample.

    The compute fault runs the script at batch 1024: a CPU quota slows only a burst of CPU
    longer than what is left of the period's quota (1.25 ms of every 5 ms at 2x), and the
    default batch's 1-3 ms of compute between long waits often fit in it -- the fault
    achieved 1.29-1.42x, with runs of healthy-looking steps (15 in a row in one CI run: a
    real onset at step 32, not a rank slow from its start). At 1024 (~15 ms of compute) it
    achieved 1.75x and 3-12% of the steps looked healthy. A rank the audit let go (1.65x,
    the slowest in 2 of 3 rounds) is tested for 10 rounds, and one a change point brings to
    validation that sat above its peers over the whole window is named slow since the
    monitor's first sample (localize._slow_all_along): before, each such alarm was let go as
    "did not rise" and the rank was named once a rise showed (CI: onset 818)."""
    cmd = [sys.executable, "-m", "stalwart.cli", "run", "--script", "tests/scripts/plain_ddp.py",
           "--testbed", "netns", "--nproc", "4", "--detect", "--fault", fault,
           "--out", str(tmp_path), "--name", "born", "--no-progress", "--",
           "--seconds", "9", "--batch", str(batch)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    found = RunData.load(tmp_path / "born").events_of("straggler_detected")
    assert found, "no straggler detected"
    first = found[0]
    assert first["kind"] == kind and first["ranks"] == ranks, first
    if link is not None:
        assert first["link"] == link, first
    assert first["evidence"].get("never_healthy") is True and first["onset_step"] <= 2, \
        (first["onset_step"], first["evidence"])
