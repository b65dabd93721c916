"""The hand-written threshold baseline on synthetic per-rank step times."""

from __future__ import annotations

import numpy as np

from stalwart.detect.baseline import threshold_detector


def table(n: int, slow_from: int | None = None, factor: float = 1.5, noise: float = 0.02,
          seed: int = 0, ranks: int = 4) -> dict[int, dict[int, float]]:
    rng = np.random.default_rng(seed)
    out: dict[int, dict[int, float]] = {}
    for s in range(n):
        base = 0.1 * (factor if slow_from is not None and s >= slow_from else 1.0)
        out[s] = {r: float(base * np.exp(rng.normal(0, noise))) for r in range(ranks)}
    return out


def test_baseline_fires_on_a_job_wide_slowdown_and_names_some_rank() -> None:
    dets = threshold_detector(table(80, slow_from=40))
    assert len(dets) == 1
    d = dets[0]
    assert d["event"] == "straggler_detected" and d["kind"] == "compute"
    assert 40 <= d["onset_step"] <= 42 and len(d["ranks"]) == 1


def test_baseline_reports_recovery() -> None:
    t = table(100, slow_from=40)
    for s in range(70, 100):
        t[s] = {r: v / 1.5 for r, v in t[s].items()}
    dets = threshold_detector(t)
    assert [d["event"] for d in dets] == ["straggler_detected", "straggler_recovered"]
    assert dets[1]["step"] >= 70


def test_baseline_is_quiet_on_stable_series() -> None:
    assert threshold_detector(table(100, noise=0.03)) == []
