"""`stalwart simulate`: bad input is one line and exit 2; a small run writes its run
directory with the issue's figure names."""

from __future__ import annotations

import json

import pytest

from tests.helpers import stalwart
from tests.test_cli_errors import assert_one_line_error


@pytest.mark.parametrize(("args", "needles"), [
    (["--ranks", "1001"], ["1001"]),
    (["--ranks", "ten"], ["ten"]),
    (["--hours", "-1"], ["--hours"]),
    (["--policies", "none,pray"], ["pray"]),
    (["--fault", "compute:rank=99999999"], ["rank=99999999"]),
    (["--noise-scale", "-2"], ["--noise-scale"]),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needles: list[str]) -> None:
    assert_one_line_error(stalwart("simulate", "--no-progress", *args, timeout=120), *needles)


def test_small_run_writes_run_directory(tmp_path) -> None:
    out = tmp_path / "figs.json"
    p = stalwart("simulate", "--ranks", "80", "--hours", "0.3", "--policies", "none,auto",
                 "--fault", "compute:rank=13,factor=2,start=30,end=80",
                 "--out", str(tmp_path), "--name", "s", "--json", str(out), "--no-progress",
                 timeout=300)
    assert p.returncode == 0, p.stderr
    run = tmp_path / "s"
    for f in ("config.json", "events.jsonl", "figures.json", "report.html", "jct.png",
              "calibration.json"):
        assert (run / f).exists(), f
    figs = json.loads(out.read_text())
    for k in ("sim_step_error", "planner_ms_10k_groups", "jct_h_healthy_80", "jct_h_auto_80",
              "decision_ms_per_step_80", "false_alarms_per_day_80"):
        assert k in figs, k
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "straggler_detected" and e["scenario"] == "auto" for e in events)
