"""Fault windows in seconds (``start=10s``): the grammar, and the testbed switching on time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.config import ConfigError, RunConfig
from stalwart.rundir import EventLog, read_jsonl
from stalwart.testbed import open_testbed, parse_fault


def test_a_window_in_seconds_is_on_between_its_times_whatever_the_step() -> None:
    f = parse_fault("compute:rank=1,factor=2,start=10s,end=40.5s", 4, "local")
    assert (f.start_s, f.end_s, f.start, f.end, f.uses_steps) == (10.0, 40.5, 0, None, False)
    assert not f.active_at(10**6, None)  # time not known yet: not started
    assert [t for t in (0.0, 9.9, 10.0, 40.4, 40.5, 99.0) if f.active_at(0, t)] == [10.0, 40.4]
    fields = f.event_fields()
    assert (fields["start_s"], fields["end_s"]) == (10.0, 40.5)
    g = parse_fault("compute:rank=1,factor=2,start=10s", 4, "local")
    assert g.active_at(0, 1e9) and g.end_s is None and "end_s" not in g.event_fields()


def test_steps_and_seconds_mix_and_steps_are_flagged() -> None:
    f = parse_fault("compute:rank=0,factor=2,start=5s,end=30", 1, "local")
    assert f.uses_steps and f.active_at(29, 6.0) and not f.active_at(30, 6.0)
    assert not f.active_at(29, 4.0)
    assert parse_fault("compute:rank=0,factor=2,start=3", 1, "local").uses_steps


@pytest.mark.parametrize("spec,names", [
    ("compute:rank=0,factor=2,start=10x", "start='10x'"),
    ("compute:rank=0,factor=2,start=-3s", "start='-3s'"),
    ("compute:rank=0,factor=2,end=fives", "end='fives'"),
    ("compute:rank=0,factor=2,start=10s,end=5s", "end=5s"),
])
def test_bad_seconds_name_the_value(spec: str, names: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_fault(spec, 1, "local")
    assert names in str(e.value) and "\n" not in str(e.value)


@pytest.mark.root
def test_the_testbed_switches_a_timed_fault_on_the_launchers_clock(tmp_path: Path) -> None:
    cfg = RunConfig(nproc=1, testbed="local", faults=["compute:rank=0,factor=2,start=1s,end=2s"])
    events = EventLog(tmp_path)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open_testbed(cfg, events) as tb:
            tb.attach_ranks({0: sleeper.pid})
            tb.on_time(0.5)
            tb.on_step(7)  # steps advance too; the window is in seconds
            assert not [e for e in read_jsonl(tmp_path / "events.jsonl")
                        if e["event"].startswith("fault_")]
            tb.on_time(1.2)
            tb.on_time(2.5)
    finally:
        sleeper.kill()
        sleeper.wait()
    got = [(e["event"], e["elapsed_s"], e["step"], e["start_s"], e["end_s"])
           for e in read_jsonl(tmp_path / "events.jsonl") if e["event"].startswith("fault_")]
    assert got == [("fault_applied", 1.2, 7, 1.0, 2.0), ("fault_removed", 2.5, 7, 1.0, 2.0)]
