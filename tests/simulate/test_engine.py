"""The simulated job driven by the product's detector and policy (engine.py, decide.py)."""

from __future__ import annotations

import numpy as np

from stalwart.simulate.engine import Engine, Settings
from stalwart.simulate.faults import parse
from stalwart.simulate.model import Job, Link
from stalwart.simulate.noise import Noise

JOB = Job(dp=8, micro=32, mb_compute_s=0.01, grad_bytes=4e5, fixed_s=0.005,
          inter=Link(1e-5, 1e9))
STEP = 0.06  # roughly this job's step: converts scripted step numbers to seconds


def _run(policy: str, faults: list[str], steps: int = 240, seed: int = 0):
    fl = [parse(f, JOB.ranks, JOB.hosts, STEP) for f in faults]
    return Engine(JOB, fl, Noise.load(), Settings(policy=policy, seed=seed)).run(steps, policy)


def _names(out) -> list[str]:
    return [e["event"] for e in out.events]


def test_scripted_2x_straggler_is_detected_and_rebalanced() -> None:
    out = _run("auto", ["compute:rank=5,factor=2,start=60,end=400"])
    det = [e for e in out.events if e["event"] == "straggler_detected"]
    assert det and det[0]["kind"] == "compute" and det[0]["ranks"] == [5]
    reb = [e for e in out.events if e.get("strategy") == "rebalance"]
    assert reb and reb[0]["target"] == 5
    assert reb[0]["step"] >= det[0]["step"]
    none = _run("none", ["compute:rank=5,factor=2,start=60,end=400"])
    assert out.jct_s < none.jct_s  # the rebalanced job finished sooner


def test_clean_job_takes_no_action() -> None:
    out = _run("auto", [], steps=300)
    assert not [n for n in _names(out) if n.startswith(("straggler_", "mitigation_",
                                                           "slowdown_"))]


def test_same_seed_same_events() -> None:
    def strip(out) -> list[dict]:
        return [{k: v for k, v in e.items() if k != "evidence"} for e in out.events]
    a = _run("auto", ["compute:rank=2,factor=3,start=50,end=150"], seed=7)
    b = _run("auto", ["compute:rank=2,factor=3,start=50,end=150"], seed=7)
    assert strip(a) == strip(b) and a.jct_s == b.jct_s
    c = _run("auto", ["compute:rank=2,factor=3,start=50,end=150"], seed=8)
    assert c.jct_s != a.jct_s


def test_no_policy_means_no_decision_cost_and_no_pause() -> None:
    out = _run("none", ["compute:rank=5,factor=2,start=60"])
    assert out.decision_s == [] and out.pauses == 0
    assert "fault_applied" in _names(out)


def test_decision_cost_is_measured_per_step() -> None:
    out = _run("auto", [], steps=60)
    assert len(out.decision_s) == 60 and all(d >= 0 for d in out.decision_s)
    assert np.isfinite(out.jct_s)
