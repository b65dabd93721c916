"""The validation tests' noise in the simulator is the testbed's, not a few percent around the
ground truth (testnoise.py): measured from recorded validation rounds, with their tails."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from stalwart.detect.alarms import DETECT, Alarm
from stalwart.detect.evidence import RankEvidence
from stalwart.simulate.decide import Evidence, SimEvidence, default_test_noise
from stalwart.simulate.testnoise import TestNoise, measure


def _run(d: Path, faults: list[str], records: list[dict]) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"faults": faults}))
    (d / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def _ev(rank: int, rounds: list[float], links: dict[str, float]) -> dict:
    return {"rank": rank, "compute_rounds": rounds, "links": links}


def test_measure_splits_healthy_faulty_and_link_residuals(tmp_path: Path) -> None:
    clean = _run(tmp_path / "clean", [], [{"kind": "validation", "step": 40, "evidence": [
        _ev(0, [1.0, 2.0], {"0-1": 1.0, "0-2": 4.0}), _ev(1, [1.0, 2.0], {"1-2": 2.0}),
        _ev(2, [4.0, 2.0], {})]}])
    slow = _run(tmp_path / "slow", ["compute:rank=1,factor=2,start=30",
                                    "link:host=0,rate=10mbit,start=50"], [
        {"kind": "validation", "step": 20, "evidence": [  # before both faults
            _ev(0, [1.0], {"0-1": 3.0}), _ev(1, [1.0], {"1-0": 3.0})]},
        {"kind": "validation", "step": 40, "evidence": [  # the compute fault only
            _ev(0, [1.0], {}), _ev(1, [3.0], {}), _ev(2, [1.0], {})]},
        {"kind": "validation", "step": 60, "evidence": [  # both: no link residuals
            _ev(0, [1.0], {"0-1": 9.0}), _ev(1, [2.0], {"1-2": 1.0}), _ev(2, [1.0], {})]}])
    d = measure([clean, slow])
    assert d["source"] == "clean, slow"
    # clean: per round, over the median of the healthy ranks (1 and 2)
    want = np.log([1.0, 1.0, 1.0, 1.0, 4.0, 1.0]).round(5).tolist()
    assert d["compute"][:6] == want
    # the faulty rank at 40 and 60: log(3 / 1 / 2) and log(2 / 1 / 2); never among the healthy
    assert d["compute_faulty"] == [round(float(np.log(1.5)), 5), 0.0]
    assert len(d["compute"]) == 6 + 2 + 2 + 2  # step 20 (2 ranks), 40 and 60 (2 healthy)
    # links: the clean record (median 2) and the slow run's step 20 (before the link fault)
    assert d["link"] == np.log([0.5, 2.0, 1.0, 1.0, 1.0]).round(5).tolist()


def test_measured_pools_have_the_testbed_tails() -> None:
    """A healthy rank's round reads >= 1.5x now and then at the testbed's own noise (scale
    1), a healthy pair >= 5x: what a 5% / 15% lognormal could never give (the noise alarms'
    confirmations are not ruled out by construction)."""
    tn = default_test_noise(1.0)
    assert tn.source.count(",") >= 20  # the replay corpus' runs
    rng = np.random.default_rng(0)
    rounds = tn.rounds(rng, np.ones(20000), 3)
    tests = np.median(rounds, axis=1)
    assert 1e-4 < float(np.mean(tests >= 1.5)) < 0.05
    assert float(np.mean(tn.rtts(rng, np.ones(20000)) >= 5.0)) > 1e-3
    quiet = TestNoise(tn.compute, tn.compute_faulty, tn.link, scale=0.25)
    assert float(np.max(np.median(quiet.rounds(rng, np.ones(20000), 3), axis=1))) < 1.6


def test_sim_evidence_draws_the_pools_and_keeps_rounds() -> None:
    """SimEvidence: a 2x rank reads ~2x, the others ~1x, through the measured pools; more
    rounds extend every rank's rounds and recompute its median."""
    n = 200
    comp = np.ones(n)
    comp[7] = 2.0
    keys = np.arange(30)
    src = Evidence(comp, np.ones(n // 8), np.arange(n) // 8, keys, np.ones((30, n)),
                   np.full(30, 1.5))
    se = SimEvidence(n, np.random.default_rng(0), default_test_noise(0.25))
    se.job = lambda: src
    ev = se.tests(Alarm(DETECT, 20, 1.3, 7), 29, RankEvidence(0))
    assert [e.rank for e in ev] == list(range(n))
    peers = np.median([e.compute_test for e in ev if e.rank != 7])
    assert 1.6 < ev[7].compute_test / peers < 2.5
    assert len(ev[0].links) == n  # the ring's pairs
    first = [list(e.compute_rounds) for e in ev]
    ev = se.more_rounds(3)
    assert all(e.compute_rounds[:3] == f and len(e.compute_rounds) == 6
               for e, f in zip(ev, first, strict=True))
    assert all(e.compute_test == float(np.median(e.compute_rounds)) for e in ev)
