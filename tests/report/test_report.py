"""The report on synthetic run directories: mitigation drawn and tabulated, and runs without
mitigation reported as before."""

from __future__ import annotations

import math
from pathlib import Path

from stalwart.report import build_report
from stalwart.report.mitigation import actions, has_mitigation, plan_grid, summary_row
from stalwart.rundir import RunData
from tests.report.synth import (
    FAULT,
    MITIGATED_EVENTS,
    MITIGATED_PLANS,
    png_size,
    write_run,
)

PLOTS = ("loss.png", "iteration.png", "slowness.png", "rank_times.png", "share.png")


def _mitigated(tmp_path: Path) -> Path:
    return write_run(tmp_path / "mit", MITIGATED_PLANS, MITIGATED_EVENTS, slow=(2, 30, 90))


def test_report_with_mitigation(tmp_path: Path) -> None:
    run_dir = _mitigated(tmp_path)
    page = build_report(run_dir).read_text()
    for name in PLOTS:
        assert png_size(run_dir / name)[0] > 0, name
    # the events table names every mitigation event; the mitigation table has their fields
    for ev in ("mitigation_applied", "mitigation_measured", "mitigation_reverted", "restart"):
        assert f"<td>{ev}</td>" in page, ev
    assert "<h2>Mitigation</h2>" in page
    mit = page[page.index("<h2>Mitigation</h2>"):]
    mit = mit[:mit.index("</table>")]
    for text in ("rebalance v1", "[5 5 2 4]", "rank2", "28%", "31% (85 &rarr; 59 ms/step)",
                 "reverted", "exclude_host v3", "hosts [0 1 3]", "host2", "40%",
                 "the job is faster without host 2"):
        assert text in mit, text
    assert "1 rebalance, 1 host exclusion, 1 revert, 1 restart; measured gain 31%" in page


def test_timeline_has_plan_panel(tmp_path: Path) -> None:
    """With mitigation the iteration plot gains the micro-batch panel (a taller figure)."""
    with_mit = _mitigated(tmp_path)
    without = write_run(tmp_path / "plain", None, [], slow=(2, 30, 90))
    build_report(with_mit)
    build_report(without)
    assert png_size(with_mit / "iteration.png")[1] > png_size(without / "iteration.png")[1] * 1.3


def test_report_without_mitigation_is_unchanged(tmp_path: Path) -> None:
    """Metrics without the mitigation fields and no mitigation events: the report as before."""
    events = [e for e in MITIGATED_EVENTS if e["event"] in
              ("fault_applied", "fault_removed", "straggler_detected", "straggler_recovered")]
    for legacy in (True, False):  # old metrics lines, and new ones from a run without --mitigate
        run_dir = write_run(tmp_path / f"legacy{legacy}", None, events, slow=(2, 30, 90),
                            legacy=legacy)
        run = RunData.load(run_dir)
        assert not has_mitigation(run)
        assert actions(run) == [] and summary_row(run) is None
        page = build_report(run_dir).read_text()
        assert "Mitigation" not in page and "mitigation" not in page
        assert FAULT in page and "straggler_detected" in page
        for name in PLOTS:
            assert png_size(run_dir / name)[0] > 0, name


def test_report_of_empty_run(tmp_path: Path) -> None:
    """A run directory with no metrics and no events (a run that died at start) still reports."""
    (tmp_path / "empty").mkdir()
    page = build_report(tmp_path / "empty").read_text()
    assert "<h2>Summary</h2>" in page and "Mitigation" not in page


def test_plan_grid_rows_follow_hosts(tmp_path: Path) -> None:
    """After a restart renumbers the ranks, rows are hosts: host 2's row is empty from then on
    and host 3's keeps its history though it became rank 2."""
    run = RunData.load(_mitigated(tmp_path))
    grid = plan_grid(run)
    assert grid is not None and grid.by_host
    assert grid.row_labels == ["host 0", "host 1", "host 2", "host 3"]
    col = {s: j for j, s in enumerate(grid.steps)}
    assert [grid.counts[i][col[10]] for i in range(4)] == [4, 4, 4, 4]
    assert [grid.counts[i][col[50]] for i in range(4)] == [5, 5, 2, 4]
    assert [grid.counts[i][col[96]] for i in range(4)] == [4, 4, 4, 4]
    after = [grid.counts[i][col[110]] for i in range(4)]
    assert after[0] == 6 and after[1] == 5 and math.isnan(after[2]) and after[3] == 5


def test_plan_grid_by_rank_without_hosts(tmp_path: Path) -> None:
    plans = {0: (0, [4, 4, 4, 4], [0, 1, 2, 3]), 20: (1, [5, 5, 2, 4], [0, 1, 2, 3])}
    run = RunData.load(write_run(tmp_path / "r", plans, [], steps=40))
    grid = plan_grid(run)
    assert grid is not None and not grid.by_host  # hosts equal ranks: labelled as ranks
    assert grid.row_labels == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert has_mitigation(run)  # the plan changed, even without its events


def test_actions_merge_restart_with_its_host_action(tmp_path: Path) -> None:
    run = RunData.load(_mitigated(tmp_path))
    got = [(a.step, a.kind, a.label) for a in actions(run)]
    assert got == [(37, "rebalance", "v1 rebalance rank2"), (94, "revert", "v2 uniform"),
                   (100, "host", "v3 exclude host2")]
    # a new plan against the same straggler is a replan (a short label on a busy timeline)
    run.events.insert(4, {"event": "mitigation_applied", "step": 60, "strategy": "rebalance",
                          "plan": [5, 5, 1, 5], "version": 9, "target": "rank2"})
    assert (60, "rebalance", "v9 replan") in [(a.step, a.kind, a.label) for a in actions(run)]
    # a restart without a host action at its step (e.g. the launcher's own) is drawn alone
    run.events = [e for e in run.events if e.get("strategy") != "exclude_host"
                  or e["event"] == "restart"]
    assert (100, "host", "restart on 3 hosts") in [(a.step, a.kind, a.label)
                                                  for a in actions(run)]


def test_static_uneven_split_is_not_mitigation(tmp_path: Path) -> None:
    """18 micro-batches over 4 ranks ([5 5 4 4] every step) is the uniform plan, not an action."""
    plans = {0: (0, [5, 5, 4, 4], [0, 1, 2, 3])}
    run_dir = write_run(tmp_path / "u", plans, [], steps=30)
    assert not has_mitigation(RunData.load(run_dir))
    assert "Mitigation" not in build_report(run_dir).read_text()
