"""Typed events: what a writer emits is what a reader parses, and one phrasing for people."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

from stalwart import events
from stalwart.rundir import EventLog, RunData


def test_a_typed_event_round_trips_through_the_run_directory(tmp_path: Path) -> None:
    written = [
        events.StragglerDetected(40, 31, "compute", [2], 1.8, {"x": 1}),
        events.StragglerDetected(44, 30, "link", [], 3.0, link=[1, 2]),
        events.StragglerRecovered(70, 66, "compute", [2], 40, 31, 1.02),
        events.MitigationApplied(43, 40, "rebalance", 1, [4, 4, 2, 6], "rank2", 0.2, "slow"),
        events.MitigationMeasured(55, 1, "rebalance", 0.2, 0.18, 0.1, 0.082),
    ]
    log = EventLog(tmp_path)
    for ev in written:
        log.emit(ev)
    log.log("note", step=50, text="x")  # a kind this module does not type
    log.close()
    lines = RunData.load(tmp_path).events
    assert [events.parse(e) for e in lines] == [*written, None]
    assert "link" not in lines[0] and lines[1]["link"] == [1, 2]  # optional fields left out


def test_one_phrasing_for_steps_and_for_a_script_runs_iterations() -> None:
    d = {"event": "straggler_detected", **events.StragglerDetected(
        40, 31, "compute", [2], 1.8).fields()}
    assert events.describe(d) == "straggler: compute rank 2 x1.80 since step 31"
    assert events.describe(d, unit="iteration").endswith("since iteration 31")
    pair = {"event": "straggler_detected", "kind": "link", "ranks": [], "link": [1, 2],
            "severity": 3.0, "onset_step": 30}
    assert events.describe(pair) == "straggler: link 1-2 x3.00 since step 30"
    assert events.describe({"event": "eval", "step": 3}) is None
    assert events.parse({"event": "straggler_detected", "step": 3}) is None  # fields missing


def test_the_package_imports_no_torch_and_nothing_else_of_stalwart() -> None:
    """Every module of stalwart may read events: importing them loads only stalwart.events
    (and its own modules), never torch."""
    code = ("import sys, stalwart.events\n"
            "print(' '.join(m for m in sys.modules if m == 'torch' or m.startswith('torch.')"
            " or (m.startswith('stalwart.') and not m.startswith('stalwart.events'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == []


def test_every_type_of_a_domain_module_is_exported_by_the_package() -> None:
    mods = [m for m in pkgutil.iter_modules(events.__path__)]
    assert mods
    for m in mods:
        mod = importlib.import_module(f"stalwart.events.{m.name}")
        for name, t in inspect.getmembers(mod, inspect.isclass):
            if t.__module__ == mod.__name__ and not name.startswith("_"):
                assert getattr(events, name) is t, f"stalwart.events.{name}"
