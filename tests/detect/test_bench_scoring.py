"""Scoring of `stalwart bench detect`: ground truth from events, matching, localisation."""

from __future__ import annotations

from stalwart.bench.detect import Scenario, Truth, ground_truth, localised, scenarios, score


def test_full_mode_has_at_least_twenty_runs_covering_every_fault_kind() -> None:
    full = scenarios(quick=False)
    assert len(full) >= 20
    kinds = {f.split(":")[0] for sc in full for f in sc.faults}
    assert kinds == {"compute", "link", "pairlink", "contention"}
    assert sum(not sc.faults for sc in full) >= 10  # silence is scored over 10 clean runs
    assert any("end=" in f for sc in full for f in sc.faults)


def test_ground_truth_pairs_applied_and_removed_events() -> None:
    ev = [{"event": "fault_applied", "step": 30, "kind": "compute", "rank": 2},
          {"event": "fault_removed", "step": 50, "kind": "compute", "rank": 2},
          {"event": "fault_applied", "step": 30, "kind": "link", "hosts": [1]},
          {"event": "fault_removed", "step": 70, "kind": "link", "hosts": [1], "at_close": True}]
    t = ground_truth(ev)
    assert [(x.kind, x.applied, x.removed) for x in t] == [("compute", 30, 50), ("link", 30, None)]


def test_localisation_rules() -> None:
    comp = Truth("compute", 30, None, 2, [])
    assert localised({"kind": "compute", "ranks": [2]}, comp)
    assert not localised({"kind": "compute", "ranks": [2, 3]}, comp)
    assert not localised({"kind": "link", "ranks": [2], "link": [1, 2]}, comp)
    host = Truth("link", 30, None, None, [1])
    assert localised({"kind": "link", "ranks": [1], "link": [0, 1]}, host)
    assert localised({"kind": "link", "ranks": [], "link": [1, 2]}, host)
    assert not localised({"kind": "compute", "ranks": [1]}, host)
    pair = Truth("pairlink", 30, None, None, [1, 2])
    assert localised({"kind": "link", "link": [2, 1]}, pair)
    assert not localised({"kind": "link", "link": [0, 1]}, pair)


def test_score_counts_false_positives_detections_latency_and_accuracy() -> None:
    clean = Scenario("clean")
    faulty = Scenario("c", ("compute:rank=2,factor=2,start=30",))
    t = [Truth("compute", 30, None, 2, [])]
    det = {"event": "straggler_detected", "step": 33, "onset_step": 30, "kind": "compute",
           "ranks": [2]}
    early = dict(det, step=12, onset_step=10)  # decided before the fault: not a detection
    s = score([(clean, [det], [], 70), (faulty, [early, det], t, 70)])
    assert s["false_positives"] == 1 and s["early_detections"] == 1
    assert s["detection_rate"] == 1.0 and s["localization_accuracy"] == 1.0
    assert s["median_latency_iters"] == 3
    s = score([(faulty, [], t, 70)])
    assert s["detection_rate"] == 0.0 and s["localization_accuracy"] is None
