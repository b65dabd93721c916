"""Calibration cases from the recorded runs' summaries (calibrate.py): every fault kind of
the testbed is a prediction, the healthy fits are listed apart."""

from __future__ import annotations

from stalwart.simulate import calibrate
from stalwart.simulate.noise import Noise


def test_every_recorded_case_is_predicted() -> None:
    sums = calibrate.load()
    kinds = {f["kind"] for s in sums for f in s["faults"]}
    assert {"compute", "link", "pairlink", "contention"} <= kinds
    assert {s["preset"] for s in sums} == {"tiny", "small"}
    rows = calibrate.predict_all(sums, Noise.load())
    preds = [r for r in rows if r["kind"] == "prediction"]
    assert len(preds) == sum(1 for s in sums if s["faults"]) + sum(
        1 for s in sums if s["ranks"] == 8)
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in rows)
    assert calibrate.step_error(rows) == max(abs(r["error"]) for r in preds)
