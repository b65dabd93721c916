"""The report's rows for a rank lost and the in-place regroup after it: who died, the new
membership, and the step time before and after (a synthetic run: 4 ranks, then 3)."""

from __future__ import annotations

from pathlib import Path

from stalwart.report import mitigation
from stalwart.rundir import RunData
from tests.report.synth import write_run


def test_a_lost_rank_and_its_regroup_show_with_the_step_time_around_them(
        tmp_path: Path) -> None:
    plans = {0: (0, [4, 4, 4, 4], [0, 1, 2, 3]), 60: (0, [6, 5, 5], [0, 1, 2])}
    events = [
        {"event": "fault_applied", "step": 60, "kind": "kill", "target": "rank3", "rank": 3,
         "magnitude": 1.0, "spec": "kill:rank=3,at=60"},
        {"event": "rank_lost", "step": 60, "rank": 3, "host": 3, "exit_code": -9, "error": ""},
        {"event": "regroup", "step": 60, "generation": 1, "world": 3, "members": [0, 1, 2],
         "hosts": [0, 1, 2], "lost": [3], "regroup_s": 0.11, "planned": False},
    ]
    run = RunData.load(write_run(tmp_path / "r", plans, events))
    assert mitigation.has_mitigation(run)
    assert mitigation.summary_row(run) == "1 rank lost, 1 in-place regroup"
    assert [(a.step, a.label) for a in mitigation.actions(run)] == [(60, "regroup on 3 ranks")]
    table = mitigation.table_html(run)
    assert "rank 3 (host 3)" in table and "hosts [0 1 2]" in table and "without [3]" in table
    before, after = mitigation.step_time_around(run, 60, 60)
    # the synthetic step time is the slowest rank's share: 4 micro-batches, then 6
    assert before is not None and after is not None and after > 1.3 * before
    assert f"{before * 1000:.0f} &rarr; {after * 1000:.0f} ms/step" in table


def test_a_failed_regroup_shows_its_reason_and_the_fallback(tmp_path: Path) -> None:
    plans = {0: (0, [4, 4, 4, 4], [0, 1, 2, 3]), 61: (0, [6, 5, 5], [0, 1, 2])}
    failed = {"event": "regroup_failed", "step": 61, "generation": 1,
              "reason": "launch rank 0 cannot build the groups", "fallback": "restart",
              "hosts": [0, 1, 2], "failed": [0], "resume_step": 61}
    events = [
        {"event": "rank_lost", "step": 60, "rank": 3, "host": 3, "exit_code": -9, "error": ""},
        failed,
        {"event": "restart", "step": 61, "nproc": 3, "hosts": [0, 1, 2],
         "strategy": "fallback", "reason": "in-place regroup failed"},
    ]
    run = RunData.load(write_run(tmp_path / "r", plans, events))
    assert mitigation.summary_row(run) == "1 restart, 1 rank lost, 1 failed regroup"
    table = mitigation.table_html(run)
    assert "regroup_failed" in table and "fallback: restart" in table
    assert "relaunched from step 61" in table and "cannot build the groups" in table
    from stalwart import events as ev

    assert ev.parse(failed) == ev.RegroupFailed(61, 1, "launch rank 0 cannot build the groups",
                                                "restart", [0, 1, 2], [0], 61)
    assert ev.describe(failed) == (
        "in-place regroup failed at step 61 (launch rank 0 cannot build the groups); fell "
        "back to a checkpoint-and-relaunch on hosts [0 1 2] from step 61")
    gave_up = {**failed, "fallback": "none"}
    assert ev.describe(gave_up).endswith("no fallback left: the job stops")
    from stalwart.progress import _fmt_event

    assert _fmt_event(failed) == ev.describe(failed)
