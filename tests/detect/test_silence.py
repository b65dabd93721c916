"""Silence on clean runs: what reaches events.jsonl, and what is only counted.

Single-process monitors fed synthetic step hints (no process group: decisions are applied
locally, validation is skipped, so every verified slowdown is "unknown" -- exactly the
slowdowns that nothing confirms).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from stalwart.detect import Monitor
from stalwart.detect.alarms import DETECT, NONE, IterSample
from stalwart.detect.decision import DecisionCore
from stalwart.rundir import RunData


def feed(mon: Monitor, times: np.ndarray) -> None:
    for step, t in enumerate(times):
        mon.step(step, {"step_time": float(t), "compute_time": 0.8 * float(t),
                        "comm_time": 0.2 * float(t)})


def steps(n: int, seed: int) -> np.ndarray:
    return 0.1 * np.exp(np.random.default_rng(seed).normal(0.0, 0.03, n))


def logged(run_dir: Path) -> list[str]:
    return [e["event"] for e in RunData.load(run_dir).events]


def test_an_os_hiccup_of_a_few_steps_is_counted_not_logged(tmp_path: Path) -> None:
    times = steps(100, 0)
    times[40:45] *= 3.0  # five slow steps, then back: nothing confirms a culprit
    mon = Monitor(run_dir=tmp_path, rank=0, world=1)
    feed(mon, times)
    assert len(mon.findings) == 1 and mon.findings[0].kind == "unknown"  # it was seen...
    mon.close()
    assert mon.hiccups == 1  # ...and counted
    events = logged(tmp_path)
    assert "slowdown_unexplained" not in events and "straggler_detected" not in events
    stats = json.loads((tmp_path / "detect_stats.json").read_text())
    assert stats["hiccups"] == 1 and stats["unexplained_logged"] == 0
    # with what was seen, for a user asking why nothing was reported
    (h,) = stats["hiccup_log"]
    assert h["onset_step"] in range(38, 46) and h["severity"] > 1.5 and "did not last" in h["why"]


def test_a_clean_run_logs_nothing(tmp_path: Path) -> None:
    mon = Monitor(run_dir=tmp_path, rank=0, world=1)
    feed(mon, steps(150, 1))
    mon.close()
    assert logged(tmp_path) == []
    assert json.loads((tmp_path / "detect_stats.json").read_text())["hiccups"] == 0


def test_a_lasting_job_wide_slowdown_is_logged_once(tmp_path: Path) -> None:
    times = steps(110, 2)
    times[40:] *= 1.6  # the whole job slower from step 40 on (load from elsewhere)
    mon = Monitor(run_dir=tmp_path, rank=0, world=1, persist=20)
    feed(mon, times)
    mon.close()
    ev = RunData.load(tmp_path).events_of("slowdown_unexplained")
    assert len(ev) == 1 and mon.hiccups == 0
    assert abs(ev[0]["onset_step"] - 40) <= 2
    assert ev[0]["evidence"]["persisted_steps"] >= 20
    assert ev[0]["evidence"]["level_ratio"] > 1.3


def test_a_recorded_clean_run_with_noisy_steps_logs_nothing(tmp_path: Path) -> None:
    """Rank 0's step hints of a clean `make run` that logged a `slowdown_unexplained` (the
    last 8 steps' level against the 20 before the onset read 1.36x; the 20 steps after the
    decision were 1.10x the steps before, rank-sum z 2.0: not a slowdown that lasts)."""
    data = json.loads((Path(__file__).parent / "data" / "clean_local_run.json").read_text())
    mon = Monitor(run_dir=tmp_path, rank=0, world=1)
    for step, t, comp, comm in data["rows"]:
        mon.step(step, {"step_time": t, "compute_time": comp, "comm_time": comm})
    mon.close()
    assert [f.onset_step for f in mon.findings] == [86, 154]  # both still seen...
    events = logged(tmp_path)  # ...and neither logged
    assert "slowdown_unexplained" not in events and "straggler_detected" not in events
    assert mon.hiccups == 2


def test_rank_sum_z_says_whether_later_samples_are_higher() -> None:
    from stalwart.detect.robust import rank_sum_z

    a = np.arange(20.0)
    assert rank_sum_z(a, a + 100.0) > 5.0 and rank_sum_z(a + 100.0, a) < -5.0
    assert abs(rank_sum_z(a, a.copy())) < 1e-9  # ties: average ranks
    assert rank_sum_z(a, np.array([])) == 0.0


def test_a_slowdown_still_open_at_close_is_not_logged_early(tmp_path: Path) -> None:
    times = steps(60, 3)
    times[45:] *= 2.0  # starts 15 steps before the end: too short to call lasting
    mon = Monitor(run_dir=tmp_path, rank=0, world=1, persist=20)
    feed(mon, times)
    mon.close()
    assert "slowdown_unexplained" not in logged(tmp_path)
    assert mon.hiccups == 1


def test_one_fault_seen_by_two_channels_is_one_finding() -> None:
    from stalwart.detect.changepoint import Change
    from stalwart.detect.localize import Finding

    core = DecisionCore(leader=True)
    core.follow.found(Finding("compute", 30, 34, 1.5, ranks=[1]))
    core.follow.watch("iteration", None)
    # the culprit's own channel fires on the same slowdown later: nothing new
    core.classify(Change(onset=31, decided=38, before=1.0, after=1.3), "rank1")
    # so does the iteration time of a slowdown that began before the decision
    core.follow.watch("rank1", None)
    core.classify(Change(onset=29, decided=39, before=1.0, after=1.4), "iteration")
    assert core.pending.action == NONE
    # another rank slowing down after the decision is a new straggler
    core.classify(Change(onset=45, decided=50, before=1.0, after=1.3), "rank2")
    assert core.pending.action == DETECT and core.pending.suspect == 2


def test_a_verdict_naming_nobody_while_a_straggler_is_active_keeps_it(tmp_path: Path) -> None:
    from stalwart.detect.localize import Finding

    mon = Monitor(run_dir=tmp_path, rank=0, world=1)
    feed(mon, steps(40, 2))
    active = Finding("compute", 30, 34, 1.5, ranks=[1])
    mon.core.follow.found(active)
    # a lagging channel; the tests name nobody
    mon.core.apply_verdict(Finding("unknown", 36, 42, 1.2), None)
    assert mon.core.active is active and mon.findings == [] and mon.hiccups == 1
    mon.close()
    assert "slowdown_unexplained" not in logged(tmp_path)


def test_a_second_slowdown_the_tests_do_not_confirm_leaves_the_active_one_followed() -> None:
    from stalwart.detect.changepoint import Change
    from stalwart.detect.localize import Finding

    core = DecisionCore(leader=True)
    for k, t in enumerate(steps(40, 3)):
        core.sample(IterSample(k, float(t), 0.8 * float(t), 0.2 * float(t)))
    active = Finding("compute", 30, 34, 1.5, ranks=[1])
    core.follow.found(active)
    core.follow.watch("rank1", 1.0)
    # the iteration time slows after the decision: maybe a second straggler
    core.classify(Change(onset=38, decided=44, before=0.1, after=0.13), "iteration")
    assert core.pending.action == DETECT and core.follow.channel == "rank1"
    core.take_pending(travels=False)
    core.apply_verdict(Finding("unknown", 38, 44, 1.3), None)  # the tests name nobody
    # recovery is still followed on the straggler's own channel, against its own level
    assert core.active is active and core.follow.channel == "rank1"
    assert core.follow.healthy == 1.0
