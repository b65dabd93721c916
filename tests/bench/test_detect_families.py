"""`stalwart bench detect`'s new scenario families and figures: born-slow faults, user
scripts, 20 clean runs, latency in seconds -- scored on synthetic events."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.bench.detect_scenarios import SCRIPTS, SCRIPTS_DIR, Scenario, run_config, scenarios
from stalwart.bench.detect_score import Clock, Truth, ground_truth, latency_s, score, severe_missed

BORN = Scenario("born-compute-r2-x2", ("compute:rank=2,factor=2",))
MLP_MID = Scenario("mlp-mid-r2-x2", ("compute:rank=2,factor=2,start=150",), workload="mlp")


def test_families_and_what_each_figure_counts() -> None:
    assert BORN.family == "born" and BORN.born and BORN.in_scripts and BORN.severe
    assert MLP_MID.family == "script" and not MLP_MID.born and MLP_MID.in_scripts
    link = Scenario("born-link-h1", ("link:host=1,rate=30mbit",))
    assert link.family == "born" and not link.in_scripts and not link.severe
    assert Scenario("c", ("compute:rank=1,factor=1.3,start=30",)).in_scripts
    assert not Scenario("k", ("contention:rank=2,procs=2,start=30",)).in_scripts
    assert Scenario("clean-0").family == "clean"
    assert Scenario("l", ("loss:host=all,p=0.05",), comm="lossy").family == "lossy"


def test_full_mode_has_every_family_and_twenty_clean_runs() -> None:
    full = scenarios(quick=False)
    clean = [sc for sc in full if sc.family == "clean"]
    assert len(clean) >= 20
    assert any(sc.workload == "varlen" for sc in clean) and any(sc.noisy for sc in clean)
    born = [sc for sc in full if sc.family == "born"]
    assert {f.split(":")[0] for sc in born for f in sc.faults} == {"compute", "link",
                                                                  "pairlink"}
    assert {"factor=2" in sc.faults[0] for sc in born if "compute" in sc.faults[0]} == {
        True, False}  # 2x and 1.3x
    assert all("start=" not in f for sc in born for f in sc.faults)
    scripts = [sc for sc in full if sc.family == "script"]
    assert {sc.workload for sc in scripts} == set(SCRIPTS)
    assert any(sc.born for sc in scripts) and any(not sc.born for sc in scripts)
    assert len({sc.name for sc in full}) == len(full)


def test_quick_mode_keeps_a_born_and_a_script_scenario() -> None:
    quick = scenarios(quick=True)
    assert any(sc.family == "born" for sc in quick)
    assert any(sc.family == "script" for sc in quick)
    assert len(quick) <= 9  # ~7 min on 2 cores with the overhead job


def test_a_script_scenario_runs_the_script_with_the_monitor(tmp_path: Path) -> None:
    for w, name in SCRIPTS.items():
        assert (SCRIPTS_DIR / name).is_file()
        # a user's script: stalwart is imported only under the bench's opt-in
        assert _stalwart_imports((SCRIPTS_DIR / name).read_text()) == ["opt-in"], w
    cfg = run_config(MLP_MID, tmp_path, "t")
    cfg.validate()
    assert cfg.script.endswith("mlp.py") and cfg.detect and cfg.script_args[0] == "--seconds"
    assert run_config(BORN, tmp_path, "t").script is None


def _stalwart_imports(src: str) -> list[str]:
    """For each import of stalwart in ``src``: "opt-in" when an enclosing ``if`` tests
    STALWART_BENCH_NVRX, else "bare"."""
    import ast

    tree = ast.parse(src)
    out: list[str] = []

    def walk(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.If) and "STALWART_BENCH_NVRX" in ast.unparse(node.test):
            guarded = True
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(m.split(".")[0] == "stalwart" for m in mods):
            out.append("opt-in" if guarded else "bare")
        for child in ast.iter_child_nodes(node):
            walk(child, guarded)

    walk(tree, False)
    return out


def _applied(t: float, step: int = 0, rank: int = 2) -> dict:
    return {"event": "fault_applied", "step": step, "time": t, "kind": "compute", "rank": rank}


def test_born_fault_latency_counts_from_the_first_iteration() -> None:
    # the fault is applied when the ranks start, 15 s before the first iteration
    truths = ground_truth([_applied(100.0)])
    assert truths[0].t_applied == 100.0
    clock = Clock(first=115.0, last=160.0)
    det = {"event": "straggler_detected", "step": 40, "onset_step": 0, "time": 127.5,
           "kind": "compute", "ranks": [2]}
    assert latency_s(det, truths[0], clock) == pytest.approx(12.5)
    s = score([(BORN, [det], truths, 200, clock)])
    assert s["detection_rate"] == 1.0 and s["median_latency_s"] == 12.5
    assert s["median_latency_iters"] == 40 and s["localization_accuracy"] == 1.0
    # a mid-run fault after the first iteration: from the fault itself
    mid = Truth("compute", 250, None, 2, [], t_applied=130.0)
    assert latency_s(dict(det, time=133.0), mid, clock) == pytest.approx(3.0)


def test_wall_clock_matching_for_a_peer_without_steps() -> None:
    t = ground_truth([_applied(130.0, step=250),
                      {"event": "fault_removed", "step": 400, "time": 150.0,
                       "kind": "compute", "rank": 2}])
    clock = Clock(first=115.0, last=170.0)
    early = {"event": "straggler_detected", "time": 120.0, "step": None, "kind": "compute",
             "ranks": [1]}
    late = dict(early, time=160.0, ranks=[2])  # after removal + 5 s: not this fault's
    s = score([(MLP_MID, [early, late], t, 500, clock)], by_time=True)
    assert s["detection_rate"] == 0.0 and s["early_detections"] == 1
    hit = dict(early, time=136.0, ranks=[2])
    s = score([(MLP_MID, [early, hit], t, 500, clock)], by_time=True)
    assert s["detection_rate"] == 1.0 and s["latencies_s"] == [6.0]
    assert s["localization_accuracy"] == 1.0 and s["median_latency_iters"] is None


def test_a_fault_never_applied_is_missed_and_clean_runs_count_every_decision() -> None:
    # the monitor never reached the start iteration: no fault_applied event
    s = score([(MLP_MID, [], [], 100, Clock())])
    assert s["faults"] == 1 and s["detection_rate"] == 0.0
    clean = Scenario("varlen-clean-0", workload="varlen")
    det = {"event": "straggler_detected", "step": 10, "time": 1.0, "kind": "compute",
           "ranks": [0]}
    s = score([(clean, [det, dict(det, step=30)], [], 100, Clock())])
    assert s["false_positives"] == 2


def test_severe_misses_name_the_2x_scenarios_not_found() -> None:
    truths = ground_truth([_applied(100.0)])
    clock = Clock(115.0, 160.0)
    mild = Scenario("mlp-born-r0-x1.3", ("compute:rank=0,factor=1.3",), workload="mlp")
    runs = [(BORN, [], truths, 100, clock), (mild, [], truths, 100, clock)]
    assert severe_missed(runs) == ["born-compute-r2-x2"]
