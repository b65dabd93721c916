"""The report of a `stalwart run --script` run: built from events.jsonl, iterations.jsonl and
the rank logs (a user's script writes no metrics.jsonl). Synthetic run directories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stalwart.report import build_report
from stalwart.rundir import JsonlWriter, atomic_write_text

T0 = 1_800_000_000.0


def _run(path: Path, events: list[dict[str, Any]], iterations: bool = True) -> Path:
    """4 ranks, 60 s; rank 2 computes 2x slower (and the job iterates 2x slower) in
    [20 s, 40 s) when `iterations`."""
    path.mkdir(parents=True)
    (path / "logs").mkdir()
    atomic_write_text(path / "config.json", json.dumps(
        {"nproc": 4, "testbed": "netns", "script": "train.py", "script_args": ["--lr", "0.1"],
         "detect": iterations}))
    for r in range(4):
        (path / "logs" / f"rank-{r}.log").write_text(f"hello from rank {r}\nbye {r}\n")
    with JsonlWriter(path / "events.jsonl") as w:
        for e in [{"event": "run_started", "time": T0}, *events,
                  {"event": "run_finished", "time": T0 + 60, "ok": True, "exit_code": 0}]:
            w.write(e)
    if iterations:
        with JsonlWriter(path / "iterations.jsonl") as w:
            t, step = T0 + 5.0, 0
            while t < T0 + 58:
                slow = T0 + 20 <= t < T0 + 40
                dt = 0.2 if slow else 0.1
                t += dt
                for r in range(4):
                    comp = 0.16 if slow and r == 2 else 0.08
                    w.write({"step": step, "rank": r, "time": t, "step_time": dt,
                             "compute_time": comp, "comm_time": dt - comp})
                step += 1
    return path


FAULT = {"kind": "compute", "rank": 2, "spec": "compute:rank=2,factor=2,start=20s,end=40s",
         "start_s": 20.0, "end_s": 40.0}


def test_faults_and_findings_share_one_clock_and_are_matched(tmp_path: Path) -> None:
    run = _run(tmp_path / "r", [
        {"event": "fault_applied", "time": T0 + 20, "step": 150, **FAULT},
        {"event": "straggler_detected", "time": T0 + 22.5, "step": 160, "onset_step": 151,
         "kind": "compute", "ranks": [2], "severity": 1.9},
        {"event": "straggler_detected", "time": T0 + 50, "step": 400, "onset_step": 390,
         "kind": "link", "ranks": [], "link": [0, 3], "severity": 1.4},
        {"event": "fault_removed", "time": T0 + 40, "step": 250, **FAULT},
    ])
    page = build_report(run).read_text()
    assert (run / "timeline.png").stat().st_size > 0
    assert "train.py --lr 0.1" in page and "outcome</th><td>ok" in page
    assert "2.00x the fault-free median" in page  # rank 0's iterations inside vs outside
    # the fault is matched with the finding that names its rank, 2.5 s after it started
    assert "<b>found</b> compute straggler: rank 2 at 22.5 s (2.5 s after the fault)" in page
    # the link finding explains no injected fault
    assert "finding link link 0-3 that no injected fault explains" in page
    assert "hello from rank 3" in page and "bye 0" in page


def test_a_fault_nothing_found_and_a_run_without_the_monitor(tmp_path: Path) -> None:
    run = _run(tmp_path / "r", [
        {"event": "fault_applied", "time": T0 + 20, "step": 0, **FAULT},
        {"event": "fault_removed", "time": T0 + 40, "step": 0, **FAULT}])
    assert "not found" in build_report(run).read_text()
    bare = _run(tmp_path / "bare", [
        {"event": "fault_applied", "time": T0 + 20, "step": 0, **FAULT},
        {"event": "rank_failed", "time": T0 + 30, "rank": 1, "exit_code": 1,
         "error": "RuntimeError: boom"}], iterations=False)
    page = build_report(bare).read_text()
    assert "not counted (run with --detect)" in page and "no monitor (run with --detect)" in page
    assert "rank 1 failed: RuntimeError: boom" in page
    assert (bare / "timeline.png").exists()


def test_a_host_finding_explains_its_hosts_link_fault() -> None:
    """Several ranks per host: the finding names host 1 (ranks 2 and 3), the fault host 1."""
    from stalwart.report.script import Span, _who, explains

    span = Span("link:host=1,rate=10mbit", "link", 0.0, None, None, [1])
    found = {"kind": "link", "ranks": [2, 3], "link": [1, 2], "evidence": {"host": "1"}}
    assert explains(found, span)
    assert not explains({**found, "evidence": {"host": "2"}}, span)
    assert _who(found) == "host 1's link (ranks 2,3)"
