"""The overlap benchmark's figures from worker outputs (synthetic numbers, no processes)."""

from __future__ import annotations

import pytest

from stalwart.bench.overlap import TARGETS, figures


def _rank(walls: dict[str, list[float]], predicted: float) -> dict:
    def step(sched: str, w: float) -> dict[str, float]:
        return {"wall": w, "compute_time": 1.0, "comm_time": 1.0, "comm_hidden": 0.0,
                "comm_exposed": 0.0, "act_peak_bytes": 110.0 if sched == "si" else 100.0,
                "bytes": 8.0}

    return {"steps": {s: [step(s, w) for w in ws] for s, ws in walls.items()},
            "plan": {"predicted_step_time": predicted, "profile": {}}, "profile_time": 0.1,
            "reps": 3, "micro_batches": 4, "si_options": {"chunks": 1},
            "variants": {"si_plain": {"predicted_step_time": 1.6}}}


def test_figures_include_the_model_error_and_the_variants() -> None:
    walls = {"off": [2.0, 2.0, 2.0], "async": [1.9, 1.9, 1.9], "si": [1.2, 1.25, 1.3],
             "si_plain": [1.5, 1.5, 1.5]}
    fig, detail = figures([_rank(walls, 1.0), _rank(walls, 1.0)])
    assert set(TARGETS) <= set(fig)
    assert fig["plan_model_error"] == pytest.approx(abs(1.0 - 1.25) / 1.25)
    assert fig["si_speedup"] == pytest.approx(2.0 / 1.25)
    assert fig["si_extra_memory"] == pytest.approx(0.1)
    assert detail["speedup_si_plain"] == pytest.approx(2.0 / 1.5)
    assert detail["si_gain_over_si_plain"] == pytest.approx(1.5 / 1.25)
    assert detail["predicted_step_time_si_plain"] == 1.6
