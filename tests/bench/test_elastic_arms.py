"""``bench elastic``: the figure names the issue fixes, from synthetic episodes of every arm; and
(slow) the peers' harness for real -- torchrun's elastic restart and torchft on two emulated
nodes (netns hosts as root, local processes otherwise), one killed, no restart."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from stalwart.bench import SUITES, BenchResult
from stalwart.bench import elastic as be
from stalwart.bench import elastic_arms as ea
from stalwart.bench import elastic_figures as ef

CONTRACT = ("torchrun_failstop_resume_s", "torchrun_elastic_resume_s",
            "torchft_failstop_resume_s", "torchrun_failstop_samples_lost",
            "torchrun_workers_restarted", "torchrun_rejoin_s", "script_failstop_resume_s",
            "script_samples_lost", "script_val_loss_rel_change", "hang_detect_s",
            "time_to_samples_ratio")


def _lines(steps: range, members: int, world: int, gen: int, t0: float,
           dt: float) -> list[dict[str, Any]]:
    return [{"step": s, "t": t0 + (k + 1) * dt, "samples": 64 // world, "world": world,
             "gen": gen, "member": m} for k, s in enumerate(steps) for m in range(members)]


def _episode(arm: str, fault: str, recs: list[dict[str, Any]], t_fault: float,
             t_back: float | None = None) -> ea.Episode:
    e = ea.Episode(arm, fault, Path("/nonexistent"), recs, t_fault, t_back, {},
                   finished=fault == "kill")
    return e


def test_every_figure_the_issue_names_is_emitted_with_its_value() -> None:
    p = ea.Plan(steps=30, nodes=4, per_node=2)
    # ours: in place, 0.2 s; torchrun elastic: 4 s and 5 steps redone; torchft: 5 s
    ours = _lines(range(0, 10), 8, 8, 0, 0.0, 0.1) + _lines(range(10, 20), 6, 6, 1, 1.2, 0.1) \
        + _lines(range(20, 30), 8, 8, 2, 3.0, 0.1)
    te = _lines(range(0, 10), 8, 8, 0, 0.0, 0.1) + _lines(range(5, 30), 8, 8, 1, 5.0, 0.1)
    ft = _lines(range(0, 10), 8, 8, 0, 0.0, 0.1) + _lines(range(10, 30), 6, 6, 1, 6.0, 0.1)
    val = [{"final": True, "val_loss": 1.0}]
    eps = {"stalwart": {"kill": _episode("stalwart", "kill", ours + val, 1.0, 2.5),
                        "hang": _episode("stalwart", "hang", ours, 1.0)},
           "torchrun_elastic": {"kill": _episode("torchrun_elastic", "kill", te + val, 1.0)},
           "torchft": {"kill": _episode("torchft", "kill", ft + val, 1.0)}}
    figs: dict[str, float | None] = dict.fromkeys(be.figure_names())
    for arm, e in eps.items():
        figs.update(be.arm_figures(arm, e, p, healthy_val=1.0))
    tf, n = be.time_figures({a: e["kill"] for a, e in eps.items()})
    figs.update(tf)
    assert set(CONTRACT) <= set(figs) and set(figs) == set(be.figure_names())
    assert figs["torchrun_failstop_resume_s"] == pytest.approx(0.3)
    assert figs["hang_detect_s"] == pytest.approx(0.3)
    assert figs["torchrun_elastic_resume_s"] == pytest.approx(4.1)
    assert figs["torchft_failstop_resume_s"] == pytest.approx(5.1)
    assert figs["torchrun_rejoin_s"] == pytest.approx(0.6)
    assert figs["torchrun_elastic_samples_lost"] == 5 * 64  # redone from the checkpoint
    assert figs["torchft_failstop_samples_lost"] == 20 * (64 - 60)
    assert figs["torchrun_val_loss_rel_change"] == 0.0
    # N = the smallest total any arm trained; ours reaches it first
    assert n == ef.samples_trained(ft + val)
    assert figs["time_to_samples_ratio"] == pytest.approx(
        figs["time_to_samples_s"] / min(figs["torchrun_elastic_time_to_samples_s"],
                                        figs["torchft_time_to_samples_s"]))
    assert figs["torchft_hang_detect_s"] is None  # no hang run: null, still emitted
    res = BenchResult("elastic", figs, targets=dict(be.TARGETS))
    assert res.verdicts()["torchrun_failstop_resume_s"] is True
    assert "elastic" in SUITES


def test_a_run_that_did_not_finish_gives_no_time_to_samples() -> None:
    ok = _episode("stalwart", "kill", _lines(range(0, 10), 8, 8, 0, 0.0, 0.1), 0.5)
    bad = _episode("torchft", "kill", _lines(range(0, 4), 8, 8, 0, 0.0, 0.1), 0.5)
    bad.finished = False
    tf, n = be.time_figures({"stalwart": ok, "torchft": bad})
    assert n == 640 and tf["torchft_time_to_samples_s"] is None
    assert tf["time_to_samples_ratio"] is None  # no peer to compare with


# ---- the harness for real -------------------------------------------------------------------
SMALL = ea.Plan(steps=150, batch=16, nodes=2, per_node=1, compute_ms=20.0, fault_at=20,
                back_after_s=None, cap_s=30.0, run_timeout_s=150.0, ckpt_every=10)


def _netns() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


@pytest.mark.slow
@pytest.mark.skipif(not ea.TorchrunElastic.script.is_file(), reason="no plain_ddp_ckpt.py")
def test_torchrun_elastic_restarts_the_survivor_from_its_checkpoint(tmp_path: Path) -> None:
    """Node 1 killed after step 20: torchrun restarts node 0's worker at world 1, which
    resumes from the last checkpoint and trains every step; the redone steps are lost."""
    ep = ea.run_episode(ea.make_arm("torchrun_elastic", SMALL, _netns()), "kill", tmp_path,
                        say=lambda _s: None)
    assert ep.t_fault is not None and ep.finished, ep.notes
    r = ep.records
    assert ef.resume_s(r, ep.t_fault) is not None
    assert ef.workers_restarted(ep.seen, ep.t_fault, faulted_node=1) >= 1
    ks = ef.kept(r)
    assert [e.step for e in ks] == list(range(SMALL.steps))
    g0 = ef.generation_at(r, ep.t_fault)
    after = [e for e in ks if e.generation > g0]  # (the step in flight may end at world 2)
    assert after and {e.world for e in after} == {1} and {e.samples for e in after} == {16}
    lost = ef.samples_lost(r, SMALL.batch)
    assert lost is not None and 0 <= lost <= (SMALL.ckpt_every + 1) * SMALL.batch


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                    reason="torchft is not installed (pip install 'stalwart[peers]')")
def test_torchft_goes_on_without_the_killed_replica_and_loses_its_share(tmp_path: Path
                                                                       ) -> None:
    """Replica 1's node killed after step 20: replica 0 commits every later step alone (its
    quorum of one), nothing restarted, the dead replica's share of each of them lost."""
    ep = ea.run_episode(ea.make_arm("torchft", SMALL, _netns()), "kill", tmp_path,
                        say=lambda _s: None)
    assert ep.t_fault is not None and ep.finished, ep.notes
    r = ep.records
    assert ef.resume_s(r, ep.t_fault) is not None
    assert ef.workers_restarted(ep.seen, ep.t_fault, faulted_node=1) == 0
    ks = ef.kept(r)
    assert [e.step for e in ks] == list(range(SMALL.steps))
    g0 = ef.generation_at(r, ep.t_fault)
    after = [e for e in ks if e.generation > g0]  # (the step in flight may end at world 2)
    assert after and {e.world for e in after} == {1} and {e.samples for e in after} == {8}
    lost = ef.samples_lost(r, SMALL.batch)
    assert lost is not None and lost >= 8 * len(after)
    assert ef.final_val_loss(r) is not None
