"""The progress display: mitigation events as one line each, and the plan in force."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stalwart.config import RunConfig
from stalwart.progress import Progress, _fmt_event, uniform_plan


def _applied(plan: list[int], target: str, strategy: str = "rebalance", version: int = 1,
             step: int = 37, gain: float = 0.28) -> dict[str, Any]:
    return {"event": "mitigation_applied", "time": 1.0, "step": step, "decided_step": step - 1,
            "strategy": strategy, "plan": plan, "version": version, "predicted_gain": gain,
            "target": target, "reason": "why"}


def test_uniform_plan() -> None:
    assert uniform_plan(16, 4) == [4, 4, 4, 4]
    assert uniform_plan(18, 4) == [5, 5, 4, 4]


def test_rebalance_line() -> None:
    e = _applied([5, 5, 2, 4], "rank2")
    assert _fmt_event(e) == "rebalanced: rank2 4->2 micro-batches from step 37, predicted -28%"
    # against the plan in force, not the uniform one
    e = _applied([5, 5, 1, 5], "rank2", version=2, step=64, gain=0.17)
    assert _fmt_event(e, plan=[5, 5, 2, 4]) == \
        "rebalanced: rank2 2->1 micro-batches from step 64, predicted -17%"
    # a replan that leaves the target's share names the ranks that moved
    e = _applied([4, 5, 1, 6], "rank2", version=3, step=120, gain=0.15)
    assert _fmt_event(e, plan=[5, 5, 1, 5]) == ("replanned around rank2: rank0 5->4, rank3 5->6 "
                                                "micro-batches from step 120, predicted -15%")
    # tensor parallel: rank4 is data-parallel rank 2 at tp 2
    assert _fmt_event(_applied([5, 5, 2, 4], "rank4"), tp=2) == \
        "rebalanced: rank4 4->2 micro-batches from step 37, predicted -28%"
    # an unexpected target still gives a line with the plan
    assert _fmt_event(_applied([5, 5, 2, 4], "group2")) == \
        "rebalanced to plan v1 [5 5 2 4] from step 37, predicted -28%"


def test_host_actions_and_restarts() -> None:
    e = _applied([0, 1, 3], "host2", strategy="exclude_host", version=3, step=100, gain=0.4)
    assert _fmt_event(e) == "excluding host 2: restart on 3 hosts at step 100, predicted -40%"
    e = _applied([0, 1, 2, 3], "host2", strategy="restore_host", version=4, step=180, gain=0.2)
    assert _fmt_event(e) == "taking host 2 back: restart on 4 hosts at step 180, predicted -20%"
    r = {"event": "restart", "time": 1.0, "step": 100, "nproc": 3, "hosts": [0, 1, 3],
         "reason": "why"}
    assert _fmt_event(r, hosts=[0, 1, 2, 3]) == \
        "restarted on 3 hosts without host 2, from step 100"
    back = {**r, "step": 180, "nproc": 4, "hosts": [0, 1, 2, 3]}
    assert _fmt_event(back, hosts=[0, 1, 3]) == \
        "restarted on 4 hosts with host 2 back, from step 180"
    assert _fmt_event(r) == "restarted on 3 hosts [0 1 3], from step 100"  # hosts before unknown


def test_revert_and_measured_lines() -> None:
    rev = {"event": "mitigation_reverted", "time": 1.0, "step": 94, "strategy": "rebalance",
           "version": 2, "reason": "straggler recovered"}
    assert _fmt_event(rev) == "reverted to uniform plan at step 94"
    meas = {"event": "mitigation_measured", "time": 1.0, "step": 42, "version": 1,
            "strategy": "rebalance", "predicted_gain": 0.28, "measured_gain": 0.31,
            "step_time_before": 0.085, "step_time_after": 0.0587}
    assert _fmt_event(meas) == "measured gain 31% (predicted 28%) for plan v1"
    assert _fmt_event({**meas, "strategy": "revert", "version": 2, "predicted_gain": 0.0}) == \
        "measured gain 31% after the revert (plan v2)"
    assert _fmt_event({**meas, "measured_gain": None}) is None  # malformed: no line, no crash


def test_other_events_unchanged() -> None:
    assert _fmt_event({"event": "straggler_recovered", "step": 92}) == \
        "straggler recovered at step 92"
    assert _fmt_event({"event": "checkpoint", "step": 100}) is None


def _cfg() -> RunConfig:
    return RunConfig(nproc=4, steps=200, mitigate="rebalance", global_batch=32,
                     micro_batch_size=2).validate()  # 16 micro-batches per step


def _line(step: int, rank: int, n: int, version: int, host: int | None = None) -> dict[str, Any]:
    return {"step": step, "rank": rank, "time": 1000.0 + step + rank / 10, "loss": 3.0,
            "tokens": 64 * n, "micro_batches": n, "plan_version": version,
            "host": rank if host is None else host}


def test_live_line_shows_plan_in_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    p = Progress(_cfg(), tmp_path, enabled=True)
    assert not p.live  # captured output: the plain lines
    for r in range(4):
        p.on_metric(_line(36, r, 4, 0))
    assert "plan" not in p.info()  # uniform plan: nothing to show
    p.on_event(_applied([5, 5, 2, 4], "rank2"))
    for r, n in enumerate([5, 5, 2]):  # step 37's lines not all in: still the old plan
        p.on_metric(_line(37, r, n, 1))
    assert "plan v" not in p.info()
    p.on_metric(_line(37, 3, 4, 1))
    assert "plan v1 [5 5 2 4]" in p.info()
    p.on_event({"event": "mitigation_reverted", "time": 2.0, "step": 94, "strategy": "rebalance",
                "version": 2, "reason": "recovered"})
    for r in range(4):
        p.on_metric(_line(94, r, 4, 2))
    assert "plan v" not in p.info()  # back to uniform
    out = capsys.readouterr().out
    assert "stalwart: rebalanced: rank2 4->2 micro-batches from step 37, predicted -28%" in out
    assert "stalwart: reverted to uniform plan at step 94" in out


def test_restart_without_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Progress(_cfg(), tmp_path, enabled=True)
    for r in range(4):
        p.on_metric(_line(99, r, 4, 0))
    restart = {"event": "restart", "time": 3.0, "step": 100, "nproc": 3, "hosts": [0, 1, 3],
               "strategy": "exclude_host", "reason": "why"}
    p.on_event(restart)
    for r, h in enumerate([0, 1, 3]):
        p.on_metric(_line(100, r, [6, 5, 5][r], 0, host=h))
    info = p.info()
    assert "host 2 excluded" in info and "plan v" not in info  # [6 5 5] is uniform over 3
    # the launcher re-reads both files from the start after a restart: nothing is shown twice
    p.on_event(restart)
    p.on_metric(_line(99, 3, 4, 0))
    out = capsys.readouterr().out
    assert out.count("restarted on 3 hosts without host 2, from step 100") == 1
    assert p.step == 100


def test_tensor_parallel_plan_per_dp_rank(tmp_path: Path) -> None:
    cfg = RunConfig(nproc=4, tp=2, steps=50, mitigate="rebalance", global_batch=16,
                    micro_batch_size=2).validate()  # 8 micro-batches over 2 DP ranks
    p = Progress(cfg, tmp_path, enabled=False)
    for r, n in enumerate([5, 5, 3, 3]):
        p.on_metric(_line(10, r, n, 1))
    assert p.plan_text() == "plan v1 [5 3]"
