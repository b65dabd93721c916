"""Calibration cases from the recorded runs' summaries (calibrate.py): every fault kind of
the testbed is a prediction, the healthy fits are listed apart, and load between windows is
normalised by the ranks' measured delivered CPU rate."""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import pytest

from stalwart.simulate import calibrate
from stalwart.simulate.noise import Noise


def test_every_recorded_case_is_predicted() -> None:
    sums = calibrate.load()
    kinds = {f["kind"] for s in sums for f in s["faults"]}
    assert {"compute", "link", "pairlink", "contention"} <= kinds
    assert {s["preset"] for s in sums} == {"tiny", "small"}
    assert any(s["ranks_per_host"] > 1 for s in sums)  # several ranks per host
    assert calibrate.has_rates(sums)
    rows = calibrate.predict_all(sums, Noise.load())
    preds = [r for r in rows if r["kind"] == "prediction"]
    fits = [r for r in rows if r["kind"] == "fit"]
    # fits: the presets' base runs only; predictions: every fault window, and every other
    # run's healthy window from its preset's base
    assert len(fits) == len(calibrate.BASE)
    assert len(preds) == sum(1 for s in sums if s["faults"]) + len(sums) - len(calibrate.BASE)
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in rows)
    assert calibrate.step_error(rows) == max(abs(r["error"]) for r in preds)
    # the protocol before the rates still runs on the same summaries
    wall = calibrate.predict_all(sums, Noise.load(), rates=False)
    assert all(r.get("load_norm", 1.0) in (1.0, 2.0) for r in wall)


def test_a_window_with_half_the_delivered_rate_is_predicted_at_double_the_cpu_costs() -> None:
    sums = {s["name"]: s for s in calibrate.load()}
    base = sums["tiny4-healthy"]
    slow = copy.deepcopy(base)
    slow["name"] = "tiny4-slow"
    slow["healthy_rate"] = {r: v / 2 for r, v in base["healthy_rate"].items()}
    noise = Noise.load()
    rows = calibrate.predict_all([base, slow], noise)
    row = next(r for r in rows if r["case"].startswith("tiny4-slow"))
    assert row["load_norm"] == pytest.approx(2.0)
    c, comm = calibrate.fit(base, noise)
    want = calibrate._median_step(calibrate._job(base, 4, 2 * c, 2 * comm), [], noise, 0)
    assert row["predicted_s"] == pytest.approx(want, abs=1e-4)


def test_a_cpu_faults_rank_gets_its_own_measured_rate_ratio() -> None:
    s = next(s for s in calibrate.load() if s["name"] == "tiny4-compute")
    s = copy.deepcopy(s)
    s["healthy_rate"] = {"0": 0.4, "1": 0.4, "2": 0.4, "3": 0.4}
    s["fault_rate"] = {"0": 0.2, "1": 0.2, "2": 0.1, "3": 0.2}  # load doubled; rank 2 x 2 more
    row = calibrate._fault_row(s, Noise.load(), 0, rates=True)
    assert row["load_norm"] == pytest.approx(2.0)
    assert row["achieved"] == {"2": pytest.approx(2.0)}
    # the all-reduce's CPU work goes at the slowest rank's pace: rank 2's, 4x slower
    assert row["comm_norm"] == pytest.approx(4.0)


def test_rates_are_cpu_over_runnable_time_per_rank_within_the_window() -> None:
    lines = [{"t": 1.0, "rank": 0, "cpu_s": 9.0, "wait_s": 0.0},  # before the window
             {"t": 2.0, "rank": 0, "cpu_s": 0.1, "wait_s": 0.3},
             {"t": 3.0, "rank": 0, "cpu_s": 0.1, "wait_s": 0.1},
             {"t": 3.0, "rank": 1, "cpu_s": 0.2, "wait_s": 0.2}]
    for x in lines:
        x["main_cpu_s"], x["main_wait_s"] = x["cpu_s"] / 2, x["wait_s"]
    assert calibrate._rates(lines, 1.5, 3.0, key="") == {"0": 0.3333, "1": 0.5}
    assert calibrate._rates(lines, 1.5, 3.0) == {"0": 0.2, "1": 0.3333}


def test_the_sampler_reads_the_threads_of_the_owners_rank_groups(tmp_path: Path) -> None:
    """A stand-in for the testbed's CPU group (its tasks file naming this thread)."""
    group = tmp_path / "stw-4242-0-r3"
    group.mkdir()
    (group / "tasks").write_text(f"{threading.get_native_id()}\n")
    (tmp_path / "stw-999-0-r1").mkdir()  # another owner's testbed: not read
    out = tmp_path / "rates.jsonl"
    s = calibrate.RateSampler(4242, out, root=tmp_path)
    s.start()
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:  # keep this thread on a CPU until a sample sees it
        sum(range(10_000))
        if out.exists() and any(json.loads(x)["cpu_s"] > 0
                                for x in out.read_text().splitlines()):
            break
    s.stop.set()
    s.join()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines and {x["rank"] for x in lines} == {3}
    assert sum(x["cpu_s"] for x in lines) > 0
    assert all(x["main_cpu_s"] == x["cpu_s"] for x in lines)  # pytest's main thread
    assert all(x["cpu_s"] >= 0 and x["wait_s"] >= 0 for x in lines)
