"""``bench elastic``'s figure arithmetic on synthetic step records (elastic_ddp.py's format):
kept executions, resume, rejoin, samples lost, time to N samples, restarted workers; and that
the module loads without torch."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from stalwart.bench import elastic_figures as ef

GB = 64


def _steps(steps: range, members: int, gen: int, t0: float, dt: float = 0.1,
           world: int | None = None, committed: bool = True,
           first_member: int = 0) -> list[dict[str, Any]]:
    """``members`` processes sharing each step's global batch equally, step s ending at
    t0 + (s - steps.start + 1) * dt."""
    w = members if world is None else world
    out = []
    for k, s in enumerate(steps):
        for m in range(first_member, first_member + members):
            out.append({"step": s, "t": t0 + (k + 1) * dt, "samples": GB // w, "world": w,
                        "gen": gen, "member": m, "loss": 1.0, "committed": committed})
    return out


def _start(m: int) -> dict[str, Any]:
    return {"start": True, "t_start": 0.0, "t_joined": 0.0, "member": m}


def test_in_place_a_kill_costs_the_step_in_flight_and_nothing_else() -> None:
    # 8 members to step 9 (t 0.1..1.0), killed at 1.05 during step 10; 6 survivors redo
    # step 10 in generation 1, done at 1.35; the node is back at 2.0 and in from step 20
    recs = [_start(m) for m in range(8)]
    recs += _steps(range(0, 10), 8, 0, 0.0)
    recs += [{"step": 10, "t": 1.04, "samples": 8, "world": 8, "gen": 0, "member": 7}]
    recs += _steps(range(10, 20), 6, 1, 1.25, world=6)  # 64 // 6 = 10 each: 60 per step
    recs += _steps(range(20, 30), 8, 2, 2.25)
    recs.append({"final": True, "steps": 30, "val_loss": 0.5})
    assert ef.resume_s(recs, 1.05) == pytest.approx(0.30)
    assert ef.rejoin_s(recs, 2.0, 8) == pytest.approx(0.35)
    assert ef.rejoin_split(recs, 2.0, 8) is None  # no process started after 2.0
    back = [{"start": True, "t_start": 2.1, "member": 8}, {"start": True, "t_start": 2.2,
                                                          "member": 9}]
    split = ef.rejoin_split(recs + back, 2.0, 8)
    assert split is not None
    assert split["startup_s"] == pytest.approx(0.2) and split["after_start_s"] == \
        pytest.approx(0.15)
    ks = ef.kept(recs)
    assert [e.step for e in ks] == list(range(30))
    assert [e.generation for e in ks[9:12]] == [0, 1, 1]
    # the dead member's line of step 10 (8) and 4 samples short on each of 10 steps
    assert ef.samples_lost(recs, GB) == 8 + 10 * 4
    assert ef.samples_trained(recs) == 20 * 64 + 10 * 60
    assert ef.final_val_loss(recs) == 0.5
    # the first line ends at 0.1; 10 steps of 64 trained at 1.0
    assert ef.time_to_samples_s(recs, 640) == pytest.approx(0.9)
    assert ef.time_to_samples_s(recs, 10**6) is None


def test_a_restart_from_a_checkpoint_redoes_steps_and_they_are_lost() -> None:
    # torchrun's elastic restart: steps 0..14 at world 8, killed at 1.6; restarted workers
    # resume from the step-10 checkpoint at 5.0 (restart count 1) and redo 10..14
    recs = _steps(range(0, 15), 8, 0, 0.0)
    recs += _steps(range(10, 20), 6, 1, 5.0, world=6)
    assert ef.resume_s(recs, 1.6) == pytest.approx(5.1 - 1.6)
    ks = ef.kept(recs)
    assert [e.step for e in ks] == list(range(20))
    assert all(e.generation == 1 for e in ks[10:])
    # steps 10..14 of the first try (5 x 64) wasted; 10 steps 4 samples short
    assert ef.samples_lost(recs, GB) == 5 * 64 + 10 * 4
    # 1,280 samples: 10 steps of 64 then 10 of 60 = 1,240 < 1,280 -> never reached
    assert ef.time_to_samples_s(recs, 1280) is None
    assert ef.time_to_samples_s(recs, 1240) == pytest.approx(6.0 - 0.1)


def test_a_joiner_counting_its_restarts_from_zero_is_one_execution_with_the_others() -> None:
    # after a rejoin the old members are at restart count 2, the new node's at 0
    recs = _steps(range(0, 5), 6, 2, 0.0, world=8)
    recs += _steps(range(0, 5), 2, 0, 0.0, world=8, first_member=6)
    ks = ef.kept(recs)
    assert len(ks) == 5 and all(e.records == 8 and e.generation == 2 for e in ks)
    assert ef.samples_lost(recs, GB) == 0
    # two tries of one step seconds apart stay two executions, neither complete
    late = _steps(range(5, 6), 2, 0, 10.0, world=8, first_member=6)
    early = _steps(range(5, 6), 6, 2, 0.0, world=8)
    assert [e.complete for e in ef.executions(early + late) if e.step == 5] == [False, False]


def test_uncommitted_tries_and_a_lone_replica_after_the_job_are_not_kept() -> None:
    # torchft: step 3's try at world 8 is discarded (kill), redone by 6 in quorum 2; the
    # restarted replica finds nobody after the job and trains steps 0..5 alone in quorum 3
    recs = _steps(range(0, 3), 8, 1, 0.0)
    recs += _steps(range(3, 4), 6, 1, 0.3, world=8, committed=False)
    recs += _steps(range(3, 6), 6, 2, 5.0, world=6)
    lone = _steps(range(0, 6), 1, 3, 40.0, world=1, first_member=7)
    recs += lone
    ks = ef.kept(recs)
    assert [(e.step, e.generation, e.world) for e in ks] == [
        (0, 1, 8), (1, 1, 8), (2, 1, 8), (3, 2, 6), (4, 2, 6), (5, 2, 6)]
    assert ef.resume_s(recs, 0.35) == pytest.approx(5.1 - 0.35)
    assert ef.rejoin_s(recs, 20.0, 8) is None  # the lone quorum is not the job at 8
    # the discarded try (6 x 8) + the lone replica's 6 x 64 + 3 steps 64 - 60 short
    assert ef.samples_lost(recs, GB) == 48 + 6 * 64 + 3 * 4


def test_a_generation_in_force_is_needed_for_a_resume() -> None:
    recs = _steps(range(0, 5), 8, 0, 10.0)
    assert ef.resume_s(recs, 1.0) is None  # the fault before any step
    assert ef.resume_s(recs, 10.25) is None  # no newer generation: the survivors never went on
    assert ef.generation_at(recs, 10.25) == 0
    assert ef.samples_lost([], GB) is None and ef.kept([]) == []


def test_restarted_workers_count_the_survivors_new_processes_only() -> None:
    seen = {100: (0, 1.0), 101: (0, 1.0), 102: (3, 1.0), 200: (0, 6.0), 201: (1, 6.0),
            300: (3, 9.0), 301: (3, 9.0)}
    assert ef.workers_restarted(seen, 5.0, faulted_node=3) == 2
    assert ef.workers_restarted(seen, 10.0, faulted_node=3) == 0


def test_ratios_healthy_batch_and_common_samples() -> None:
    a = _steps(range(0, 10), 8, 0, 0.0)
    b = _steps(range(0, 8), 8, 0, 0.0)
    assert ef.common_samples([a, b, []]) == 8 * 64
    assert ef.healthy_batch(a) == 64
    assert ef.ratio(1.0, 4.0) == 0.25 and ef.ratio(None, 1.0) is None
    assert ef.ratio(1.0, 0.0) is None
    assert ef.rel_change(1.01, 1.0) == pytest.approx(0.01)
    assert ef.rel_change(None, 1.0) is None


def test_the_figures_module_imports_no_torch() -> None:
    code = ("import sys; import stalwart.bench.elastic_figures; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tries_of_one_step_under_one_restart_count_are_told_apart_by_time() -> None:
    # torchrun: 6 members wrote step 8 at 0.9 (restart count 0) before the kill; after the
    # restart from the step-8 checkpoint at 30 s, the same 6 (their agents' counts still 0)
    # and 2 others (count 1) redo it
    first = _steps(range(0, 9), 8, 0, 0.0)
    first = [r for r in first if not (r["step"] == 8 and r["member"] >= 6)]
    redo = _steps(range(8, 12), 6, 0, 30.0, world=8) \
        + _steps(range(8, 12), 2, 1, 30.0, world=8, first_member=6)
    recs = first + redo
    ks = ef.kept(recs)
    assert [e.step for e in ks] == list(range(12))
    assert {e.samples for e in ks} == {64} and ks[8].time == pytest.approx(30.1)
    assert ef.samples_lost(recs, GB) == 6 * 8  # the first, incomplete try of step 8


def test_a_step_its_dead_member_did_not_live_to_log_is_applied_with_every_share() -> None:
    # step 5 logged by 6 of 8 (the killed node contributed, then died); nothing redoes it
    recs = _steps(range(0, 5), 8, 0, 0.0)
    recs += _steps(range(5, 6), 6, 0, 0.5, world=8)
    recs += _steps(range(6, 9), 6, 1, 2.0, world=6)
    ks = ef.kept(recs)
    assert [e.step for e in ks] == list(range(9)) and ks[5].samples == 64
    assert ef.samples_lost(recs, GB) == 3 * 4  # only the three 6-member steps' remainder
    # a try that was redone later is not the last word: waste, as before
    redo = recs + _steps(range(5, 6), 6, 1, 1.5, world=6)
    assert ef.kept(redo)[5].generation == 1
