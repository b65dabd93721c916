"""Typed events: what a writer emits is what a reader parses, and one phrasing for people."""

from __future__ import annotations

from pathlib import Path

from stalwart import events
from stalwart.rundir import EventLog, RunData


def test_a_typed_event_round_trips_through_the_run_directory(tmp_path: Path) -> None:
    written = [
        events.StragglerDetected(40, 31, "compute", [2], 1.8, {"x": 1}),
        events.StragglerDetected(44, 30, "link", [], 3.0, link=[1, 2]),
        events.StragglerRecovered(70, 66, "compute", [2], 40, 31, 1.02),
        events.MitigationApplied(43, 40, "rebalance", 1, [4, 4, 2, 6], "rank2", 0.2, "slow"),
        events.MitigationMeasured(55, 1, "rebalance", 0.2, 0.18, 0.1, 0.082),
    ]
    log = EventLog(tmp_path)
    for ev in written:
        log.emit(ev)
    log.log("note", step=50, text="x")  # a kind this module does not type
    log.close()
    lines = RunData.load(tmp_path).events
    assert [events.parse(e) for e in lines] == [*written, None]
    assert "link" not in lines[0] and lines[1]["link"] == [1, 2]  # optional fields left out


def test_one_phrasing_for_steps_and_for_a_script_runs_iterations() -> None:
    d = {"event": "straggler_detected", **events.StragglerDetected(
        40, 31, "compute", [2], 1.8).fields()}
    assert events.describe(d) == "straggler: compute rank 2 x1.80 since step 31"
    assert events.describe(d, unit="iteration").endswith("since iteration 31")
    pair = {"event": "straggler_detected", "kind": "link", "ranks": [], "link": [1, 2],
            "severity": 3.0, "onset_step": 30}
    assert events.describe(pair) == "straggler: link 1-2 x3.00 since step 30"
    assert events.describe({"event": "eval", "step": 3}) is None
    assert events.parse({"event": "straggler_detected", "step": 3}) is None  # fields missing
