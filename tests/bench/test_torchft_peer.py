"""torchft beside stalwart in ``bench mitigate``: the figures from synthetic run logs, the
path without torchft, ``--no-peers``, the launcher's keep-going mode; and (slow, root, torchft
installed) a real fail-stop episode of torchft replica groups on the netns testbed."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path
from typing import Any

import pytest

from stalwart.bench import BenchResult
from stalwart.bench import mitigate as bm
from stalwart.bench.peers import torchft_run as tr
from stalwart.rundir import RunData

GB = 32


def _line(step: int, rank: int, t: float, *, data: int | None = None, committed: bool = True,
          world: int = 4, samples: int = 8, st: float = 0.1) -> dict[str, Any]:
    return {"step": step, "data_step": step if data is None else data, "rank": rank,
            "time": t, "step_time": st, "committed": committed, "world": world,
            "samples": samples, "tokens": samples * 64}


def _failstop_run(tmp_path: Path) -> RunData:
    """4 replicas, steps 0-1 healthy, replica 3 killed at t=10.0 during step 2: the
    survivors' attempt of step 2 (data 2) is dropped, step 2 is redone on data 3 by three
    replicas and done at t=15.2, step 3 on data 4 at t=15.3."""
    m = [_line(s, r, 1.0 + s + r * 0.01) for s in (0, 1) for r in range(4)]
    m += [_line(2, r, 10.1, committed=False) for r in range(3)]
    m += [_line(2, r, 15.1 + r * 0.05, data=3, world=3) for r in range(3)]
    m += [_line(3, r, 15.3, data=4, world=3) for r in range(3)]
    ev = [{"event": "fault_applied", "kind": "kill", "rank": 3, "time": 10.0, "step": 2},
          {"event": "rank_lost", "rank": 3, "exit_code": -9, "time": 10.1, "error": ""},
          {"event": "eval", "step": 4, "val_loss": 2.0, "time": 16.0}]
    return RunData(tmp_path, {"global_batch": GB}, m, ev)


def test_failstop_figures_from_a_synthetic_episode(tmp_path: Path) -> None:
    d = _failstop_run(tmp_path)
    assert tr.resume_s(d) == pytest.approx(15.2 - 10.0)
    # data 2: nothing committed (32); data 3 and 4: the dead replica's shard (8 each)
    assert tr.samples_lost(d.metrics, GB) == 32 + 8 + 8
    assert tr.steps_dropped(d.metrics) == 1
    assert tr.committed_done(d.metrics) == pytest.approx({0: 1.03, 1: 2.03, 2: 15.2,
                                                          3: 15.3})
    assert tr.crash(d) == (False, "")


def test_a_step_not_every_member_committed_is_not_done(tmp_path: Path) -> None:
    m = [_line(0, r, 1.0) for r in range(3)]  # world 4, one line missing
    d = RunData(tmp_path, {}, m + [_line(1, r, 2.0) for r in range(4)],
                [{"event": "fault_applied", "kind": "kill", "rank": 3, "time": 0.5}])
    assert tr.committed_done(d.metrics) == {1: 2.0}
    assert tr.resume_s(d) == pytest.approx(1.5)


def test_no_kill_no_resume_and_a_healthy_run_loses_nothing(tmp_path: Path) -> None:
    m = [_line(s, r, s + 1.0) for s in range(3) for r in range(4)]
    d = RunData(tmp_path, {}, m, [])
    assert tr.resume_s(d) is None
    assert tr.samples_lost(m, GB) == 0 and tr.steps_dropped(m) == 0
    assert tr.samples_lost([], GB) is None


def test_window_tokens_per_s_counts_committed_steps_and_leaves_out_evals(tmp_path: Path
                                                                          ) -> None:
    # steps 0..3, one per second, 4 ranks x 512 tokens; an eval of 0.5 s at t=2.5
    m = [_line(s, r, 1.0 + s, st=1.0) for s in range(4) for r in range(4)]
    m.append(_line(2, 0, 3.0, committed=False))  # an attempt that was not committed
    ev = [{"event": "eval", "time": 2.5, "eval_time": 0.5, "val_loss": 1.0}]
    d = RunData(tmp_path, {}, m, ev)
    # steps 1..2: 2 x 4 x 512 tokens from t=1 (step 1's start) to t=3, less 0.5 s
    assert tr.window_tokens_per_s(d, 1, 3) == pytest.approx(4096 / 1.5)
    assert tr.window_tokens_per_s(d, 5, 9) is None
    # a step redone after a regroup (stalwart's lines: no `committed`) counts once
    dup = RunData(tmp_path, {}, m + [_line(1, 0, 2.0, st=1.0)], [])
    assert tr.window_tokens_per_s(dup, 1, 3) == pytest.approx(4096 / 2.0)


TRACEBACK = """\
[INFO] torchft::manager - should_commit
Traceback (most recent call last):
  File "/x/site-packages/torchft/ddp.py", line 76, in _comm_hook
    assert fut._fut
AssertionError
[INFO] torchft::manager - Creating LighthouseClient
"""


def test_crash_names_the_survivor_and_its_exception(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-0.log").write_text(TRACEBACK)
    ev = [{"event": "fault_applied", "kind": "kill", "rank": 3, "time": 1.0},
          {"event": "rank_lost", "rank": 3, "exit_code": -9, "time": 1.1},
          {"event": "rank_lost", "rank": 0, "exit_code": 1, "time": 2.0,
           "error": "[INFO] a log line"}]
    crashed, why = tr.crash(RunData(tmp_path, {}, [], ev))
    assert crashed and why == "AssertionError at torchft/ddp.py:76 in _comm_hook"
    assert tr.last_exception(["RuntimeError: Connection closed by peer [10.0.0.4]:5"]) == \
        "RuntimeError: Connection closed by peer [10.0.0.4]:5"
    assert tr.last_exception(["all fine"]) == ""


def test_figures_put_ours_over_torchfts_tokens_per_s(tmp_path: Path) -> None:
    fast = [_line(s, r, 1.0 + 0.5 * s, st=0.5) for s in range(6) for r in range(4)]
    slow = [_line(s, r, 1.0 + s, st=1.0) for s in range(6) for r in range(4)]
    ours = RunData(tmp_path, {}, fast, [{"event": "eval", "step": 6, "val_loss": 2.0, "time": 9.0}])
    runs = {"failstop": _failstop_run(tmp_path), "failstop_ddp": _failstop_run(tmp_path),
            "slow": RunData(tmp_path, {}, slow, []), "healthy": RunData(tmp_path, {}, fast, [])}
    figs, details = tr.figures(runs, ours, ours, (1, 5))
    assert set(figs) == set(tr.FIGURES)
    assert figs["torchft_slow_tokens_per_s_ratio"] == pytest.approx(2.0)
    assert figs["torchft_healthy_tokens_per_s_ratio"] == pytest.approx(1.0)
    assert figs["torchft_val_loss_rel_change"] == 0.0
    assert figs["torchft_ddp_crashed"] == 0.0 and details["ddp_resume_s"] == pytest.approx(5.2)
    assert details["ddp_kill_hit_a_collective"] is True  # the dropped attempt
    BenchResult("mitigate", figs).table_rows()  # every value prints


def test_without_torchft_the_figures_are_null_and_nothing_runs(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchft" else real(name, *a))
    why = bm.peer_runs(True)
    assert why is not None and "pip install 'stalwart[peers]'" in why
    assert bm.peer_runs(False) is not None and "--no-peers" in bm.peer_runs(False)

    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("torchft must not run")

    monkeypatch.setattr(tr, "measure", boom)
    figs, details = bm.torchft_side(why, bm.scenarios(True), tmp_path, "q", None, None, None)
    assert figs == dict.fromkeys(tr.FIGURES) and details == {"skipped": why}
    assert {"torchft_failstop_resume_s", "torchft_failstop_samples_lost",
            "torchft_val_loss_rel_change", "torchft_slow_tokens_per_s_ratio"} <= set(figs)


def test_install_peers_installs_pinned_torchft_without_a_torch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(tr.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    missing = ["yes"]
    monkeypatch.setattr(tr, "available", lambda: missing[0])
    bm.peer_runs(True, install=False)
    assert calls == []
    bm.peer_runs(True, install=True)
    assert calls[0][-2:] == ["--no-deps", f"torchft=={tr.TORCHFT_VERSION}"]
    assert not any(a == "torch" or a.startswith("torch>") for c in calls for a in c)
    calls.clear()
    missing[0] = None  # installed: nothing to do
    assert bm.peer_runs(True, install=True) is None and calls == []


def test_runs_follow_the_bench_scenarios() -> None:
    sc = bm.scenarios(True)
    plan = tr.plan(sc["failstop"], sc["compute2x"])
    assert set(plan) == set(tr.RUNS)
    assert plan["failstop"] == (["kill:rank=3,at=30"], 100, "allreduce")
    assert plan["failstop_ddp"][2] == "ddp" and plan["healthy"][0] == []
    assert plan["slow"][0] == sc["compute2x"].faults
    assert bm.fault_window(sc["compute2x"]) == (20, 80)
    assert bm.fault_window(bm.Scenario("x", ["link:host=1,rate=10mbit,start=20"], 50)) == \
        (20, 50)


def test_no_peers_reaches_the_suite(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from stalwart import cli

    seen: dict[str, Any] = {}

    def fake_run(quick: bool, workdir: Path, peers: bool = True,
                 install_peers: bool = False) -> BenchResult:
        seen["peers"], seen["install"] = peers, install_peers
        return BenchResult("mitigate", {"x": 1.0})

    monkeypatch.setattr(bm, "run", fake_run)
    for extra, want in (([], True), (["--no-peers"], False)):
        args = cli.build_parser().parse_args(["bench", "mitigate", "--workdir", str(tmp_path),
                                              *extra])
        assert cli._cmd_bench(args) == 0 and seen["peers"] is want
        assert seen["install"] is False
    # a suite without peers takes the option and has nothing to skip
    args = cli.build_parser().parse_args(["bench", "overlap", "--no-peers"])
    assert args.no_peers is True


class _Proc:
    def __init__(self, code: int | None) -> None:
        self.returncode = code

    def poll(self) -> int | None:
        return self.returncode


def test_keep_going_logs_a_lost_rank_and_keeps_the_others(tmp_path: Path) -> None:
    from stalwart.rankexits import drop_lost
    from stalwart.rundir import EventLog, read_jsonl

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-1.log").write_text("boom\nAssertionError\n")
    procs: dict[int, Any] = {0: _Proc(None), 1: _Proc(1), 2: _Proc(-signal.SIGKILL)}
    said: list[str] = []
    with EventLog(tmp_path) as ev:
        assert drop_lost([(1, 1), (2, -signal.SIGKILL)], procs, tmp_path, ev, said.append, 7)
        assert list(procs) == [0]
        # bad input (exit 2) stops the job as usual
        assert not drop_lost([(0, 2)], {0: _Proc(2)}, tmp_path, ev, said.append, 7)
    lost = read_jsonl(tmp_path / "events.jsonl")
    assert [(e["rank"], e["exit_code"], e["error"]) for e in lost] == [
        (1, 1, "AssertionError"), (2, -9, "")]
    assert len(said) == 2 and "rank 2 lost (killed by SIGKILL)" in said[1]


# ---- the real thing -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                    reason="torchft is not installed (pip install 'stalwart[peers]')")
def test_torchft_failstop_episode_end_to_end(tmp_path: Path) -> None:
    """4 torchft replica groups (Manager.allreduce), replica 3 killed at step 8 of 20: the
    other three go on without it after torchft's heartbeat timeout and finish every step;
    the dropped attempt and the lost shard are counted."""
    d = tr.run_one("failstop", ["kill:rank=3,at=8"], 20, "allreduce", tmp_path, "t", 2)
    assert d.rc == 0, [e for e in d.events if e["event"] in ("rank_lost", "run_finished")]
    assert [e["rank"] for e in d.events_of("rank_lost")] == [3]
    done = tr.committed_done(d.metrics)
    # every step, but that the killed replica may have committed the step in flight and died
    # before logging it (seen in 1 of 6 runs: step 7 logged by 0-2 at world 4)
    missing = set(range(20)) - set(done)
    assert len(missing) <= 1 and set(done) <= set(range(20)), sorted(done)
    for s in missing:
        lines = [m for m in d.metrics if m["step"] == s and m["committed"]]
        assert {m["rank"] for m in lines} == {0, 1, 2} and {m["world"] for m in lines} == {4}
    # the launcher sees progress every 0.1 s: the kill comes at step 8 or a few steps later.
    # After it, the steps committed once torchft's quorum dropped replica 3 (the last step
    # committed at world 4 may be logged after the kill under load). torchft forms each
    # quorum from the replicas that joined within its join timeout, so under load a late
    # survivor can miss one and the step commits at world 2 while it heals (its shard is
    # counted lost below); the others commit at world 3.
    t_kill, _ = tr.kill_time(d)  # type: ignore[misc]
    last4 = max(m["step"] for m in d.metrics if m["committed"] and m["world"] == 4)
    after = [m for m in d.metrics if m["step"] > last4 and m["committed"]]
    assert after and min(m["time"] for m in after) > t_kill
    assert 3 in {m["world"] for m in after} <= {2, 3}
    assert {m["rank"] for m in after} == {0, 1, 2}
    assert tr.resume_s(d) is not None and tr.resume_s(d) > 0
    lost = tr.samples_lost(d.metrics, GB)
    world_of = {m["step"]: m["world"] for m in after}
    assert lost is not None and lost >= 8 * sum(4 - w for w in world_of.values())  # shards
    assert d.final_val_loss() is not None and tr.crash(d) == (False, "")
