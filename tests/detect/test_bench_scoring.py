"""Scoring of `stalwart bench detect`: ground truth from events, matching, localisation."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.bench.detect import Scenario, Truth, ground_truth, localised, scenarios, score


def test_full_mode_has_at_least_twenty_runs_covering_every_fault_kind() -> None:
    full = scenarios(quick=False)
    assert len(full) >= 20
    kinds = {f.split(":")[0] for sc in full for f in sc.faults}
    assert kinds == {"compute", "link", "pairlink", "contention", "loss"}
    assert sum(not sc.faults for sc in full) >= 10  # silence is scored over 10 clean runs
    assert any("end=" in f for sc in full for f in sc.faults)
    # 1.3x compute stragglers on every rank mid-run, and detection under --comm lossy, clean too
    assert sum("factor=1.3" in f for sc in full if sc.family == "mid" for f in sc.faults) == 4
    lossy = [sc for sc in full if sc.comm == "lossy"]
    assert any(sc.stragglers == 0 for sc in lossy) and sum(sc.stragglers for sc in lossy) >= 3


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


def test_loss_is_weather_not_a_straggler() -> None:
    ev = [{"event": "fault_applied", "step": 0, "kind": "loss", "hosts": [0, 1, 2, 3]},
          {"event": "fault_applied", "step": 30, "kind": "compute", "rank": 2}]
    assert [t.kind for t in ground_truth(ev)] == ["compute"]
    assert Scenario("l", ("loss:host=all,p=0.05",), comm="lossy").stragglers == 0


def test_unexplained_slowdowns_and_crashed_runs_count_against_the_detector() -> None:
    clean = Scenario("clean")
    unexp = {"event": "slowdown_unexplained", "step": 40, "onset_step": 36, "kind": "unknown"}
    s = score([(clean, [unexp], [], 70)])
    assert s["false_positives"] == 1 and s["clean_unexplained_slowdowns"] == 1
    faulty = Scenario("c", ("compute:rank=2,factor=2,start=30",))
    t = [Truth("compute", 30, None, 2, [])]
    det = {"event": "straggler_detected", "step": 33, "onset_step": 30, "kind": "compute",
           "ranks": [2]}
    s = score([(faulty, [det], t, 70)], failed=[Scenario("clean-1"), faulty])
    assert s["false_positives"] == 1  # the crashed clean run
    assert s["faults"] == 2 and s["detection_rate"] == 0.5  # the crashed faulty run: missed


def test_abba_drains_every_on_step_that_an_off_step_follows() -> None:
    from stalwart.bench.detect import abba

    warm = 12
    sched = [abba(s, warm) for s in range(warm + 40)]
    assert all(on and not drain for on, drain in sched[:warm - 1])
    ons = [on for on, _ in sched[warm:]]
    assert ons[:8] == [True, False, False, True, True, False, False, True]
    for s in range(len(sched) - 1):
        (on, drain), (nxt, _) = sched[s], sched[s + 1]
        # an off step never inherits an exchange in flight; a drain only where one would
        assert drain == (on and not nxt)
    # paired steps: as many on as off after warm-up
    assert sum(ons) * 2 == len(ons)


class ExchangeModel:
    """The monitor's exchanges as the overhead loop sees them: an enabled ``step`` issues one
    (and completes the earlier ones, read at its check); ``drain`` completes those in
    flight. Records the calls, and every step that was switched off with an exchange still
    incomplete."""

    def __init__(self) -> None:
        self._on = True
        self.incomplete: list[int] = []
        self.calls: list[tuple[str, int]] = []
        self.off_with_exchange_in_flight: list[int] = []
        self._step = -1

    @property
    def enabled(self) -> bool:
        return self._on

    @enabled.setter
    def enabled(self, on: bool) -> None:
        if not on and self.incomplete:
            self.off_with_exchange_in_flight.append(self._step + 1)
        self._on = on

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self._step = step
        self.calls.append(("step", step))
        if self._on:
            self.incomplete = [step]

    def drain(self) -> None:
        self.calls.append(("drain", self._step))
        self.incomplete = []


def test_the_overhead_loop_drains_right_after_each_on_step_an_off_step_follows() -> None:
    from stalwart.bench.detect import begin_step, end_step

    warm, mon = 12, ExchangeModel()
    ons = []
    for step in range(warm + 40):
        ons.append(begin_step(mon, step, warm))
        end_step(mon, step, warm, {"step_time": 0.1, "compute_time": 0.1, "comm_time": 0.0})
    assert ons[:warm] == [True] * warm and ons[warm:warm + 4] == [True, False, False, True]
    # no "off" step starts while an exchange an "on" step issued is still running
    assert mon.off_with_exchange_in_flight == []
    # a drain only where one is needed (ABBA: the first step of each group of 4), each
    # right after that step's hint
    drained = [s for kind, s in mon.calls if kind == "drain"]
    assert drained == list(range(warm, warm + 40, 4))
    for s in drained:
        i = mon.calls.index(("drain", s))
        assert mon.calls[i - 1] == ("step", s)


def test_the_baseline_is_scored_on_each_ranks_compute_time(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    # one reliable run, faked: rank 2's compute doubles at step 30; the step time is the same
    # on every rank (a synchronous job waits for its slowest rank), so only the compute time
    # says which rank it is
    import stalwart.bench.detect as bench
    from stalwart.rundir import RunData

    sc = Scenario("c", ("compute:rank=2,factor=2,start=30",))
    metrics = []
    for step in range(70):
        comp = [0.10 + 0.001 * ((step * 7 + r) % 5) for r in range(4)]
        if step >= 30:
            comp[2] *= 2
        for r in range(4):
            metrics.append({"rank": r, "step": step, "step_time": max(comp) + 0.02,
                            "compute_time": comp[r]})
    events = [{"event": "fault_applied", "step": 30, "kind": "compute", "rank": 2}]
    data = RunData(tmp_path, {}, metrics, events)
    monkeypatch.setattr(bench, "scenarios", lambda quick: [sc])
    monkeypatch.setattr(bench, "run_scenario", lambda sc, workdir, tag, peer=False: (data, 0))
    monkeypatch.setattr(bench, "measure_overhead", lambda workdir, tag, steps: {})
    figures = bench.run(quick=True, workdir=tmp_path, peers=False).figures
    assert figures["baseline_detection_rate"] == 1.0
    assert figures["baseline_localization_accuracy"] == 1.0


def test_a_finding_named_as_a_host_is_scored_by_its_host() -> None:
    """Several ranks per host: host 1 holds ranks 2 and 3; its boundary pair 1-2 holds rank 1,
    which must not make a finding about host 2 count for host 1."""
    host = Truth("link", 30, None, None, [1])
    assert localised({"kind": "link", "ranks": [2, 3], "link": [3, 4],
                      "evidence": {"host": "1"}}, host)
    assert not localised({"kind": "link", "ranks": [4, 5], "link": [1, 2],
                          "evidence": {"host": "2"}}, host)
