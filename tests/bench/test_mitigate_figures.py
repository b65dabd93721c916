"""Figures of ``stalwart bench mitigate`` computed from run directories (synthetic events)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stalwart.bench.mitigate import failstop_figures, false_recoveries
from stalwart.rundir import RunData

SPEC = "compute:rank=2,factor=2,start=20,end=60"


def run(events: list[dict[str, Any]]) -> RunData:
    return RunData(Path("."), {}, [], events)


def applied(step: int, spec: str = SPEC) -> dict[str, Any]:
    return {"event": "fault_applied", "step": step, "kind": "compute", "spec": spec}


def test_recoveries_and_reverts_while_the_fault_is_on_count_after_it_do_not() -> None:
    d = run([applied(20),
             {"event": "straggler_recovered", "step": 33},  # mid-fault: false
             {"event": "mitigation_reverted", "step": 37, "decided_step": 36,
              "reason": "straggler recovered: rank 2's time per micro-batch back"},  # false
             {"event": "mitigation_reverted", "step": 45, "decided_step": 44,
              "reason": "plan v2 made steps slower (measured gain -0.10): undone"},  # not one
             {"event": "fault_removed", "step": 60, "spec": SPEC},
             {"event": "straggler_recovered", "step": 63},
             {"event": "mitigation_reverted", "step": 66, "decided_step": 65,
              "reason": "straggler recovered: back"}])
    assert false_recoveries([d]) == 2.0


def test_a_fault_removed_only_at_close_was_on_until_the_end() -> None:
    spec = "compute:rank=2,factor=2"
    d = run([applied(0, spec), {"event": "straggler_recovered", "step": 90},
             {"event": "fault_removed", "step": 100, "spec": spec, "at_close": True}])
    assert false_recoveries([d, run([])]) == 1.0


def test_rejoin_seconds_run_from_the_decision_to_the_first_step_of_the_whole_world() -> None:
    from stalwart.bench.mitigate import rejoin_s

    metrics = [{"step": 50, "world": 3, "time": 99.0, "rank": r} for r in range(3)]
    metrics += [{"step": 51, "world": 4, "time": t, "rank": r}
                for r, t in enumerate([100.6, 100.7, 100.9, 100.8])]
    metrics += [{"step": 52, "world": 4, "time": 101.0, "rank": 0}]  # not complete
    d = RunData(Path("."), {}, metrics, [
        {"event": "mitigation_applied", "strategy": "restore_host", "time": 100.0},
        {"event": "regroup", "joined": [1], "world": 4, "time": 100.3}])
    assert abs(rejoin_s(d) - 0.9) < 1e-9
    assert rejoin_s(RunData(Path("."), {}, metrics, [])) is None


def test_failstop_resume_runs_to_the_first_step_of_the_survivors_membership() -> None:
    """Rank 3 of 4 killed at t=10.0 just after step 2's all-reduce: ranks 0-2 write step 2
    at 10.001 (the dead rank's line came before the kill), then the three regroup and finish
    step 3 at world 3 at 10.6. The step in flight is trained, not a resume."""
    def line(step: int, rank: int, t: float, world: int) -> dict[str, Any]:
        return {"step": step, "rank": rank, "time": t, "world": world, "samples": 32 // world,
                "step_time": 0.3}

    m = [line(s, r, 1.0 + 3 * s, 4) for s in (0, 1) for r in range(4)]
    m += [line(2, 3, 9.99, 4)] + [line(2, r, 10.001, 4) for r in range(3)]
    m += [line(3, r, 10.6, 3) for r in range(3)]
    ev = [{"event": "fault_applied", "kind": "kill", "rank": 3, "time": 10.0, "step": 2}]
    got = failstop_figures(RunData(Path("."), {"global_batch": 30, "steps": 4}, m, ev))
    assert abs(got["failstop_resume_s"] - 0.6) < 1e-9
