"""Drawn and scripted faults (faults.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stalwart.simulate.faults import Schedule, draw, parse


def test_draw_is_deterministic_and_mostly_communication() -> None:
    a = draw(np.random.default_rng(3), 10000, 8, 30 * 86400.0)
    b = draw(np.random.default_rng(3), 10000, 8, 30 * 86400.0)
    assert [f.as_event() for f in a] == [f.as_event() for f in b]
    slow = [f for f in a if f.kind != "stop"]
    assert len(slow) > 50
    comm = sum(f.kind == "link" for f in slow) / len(slow)
    assert 0.6 < comm < 0.9  # "far more often than compute ones"
    assert all(30.0 <= f.end_s - f.start_s <= 36000.0 for f in slow)
    assert all(f.start_s <= g.start_s for f, g in zip(a, a[1:], strict=False))


def test_parse_steps_seconds_and_errors() -> None:
    f = parse("compute:rank=3,factor=2,start=30,end=60", 8, 8, 0.5)
    assert (f.kind, f.target, f.factor, f.start_s, f.end_s) == ("compute", 3, 2.0, 15.0, 30.0)
    g = parse("link:host=1,factor=20,start=12s", 8, 8, 0.5)
    assert (g.start_s, g.end_s) == (12.0, math.inf)
    for bad, needle in [("gpu:rank=1", "gpu"), ("compute:rank=9", "rank=9"),
                        ("compute:rank=1,factor=0.5", "factor"),
                        ("compute:rank=1,start=9,end=3", "end"),
                        ("link:host=1,speed=3", "speed"), ("compute:rank=x", "rank")]:
        with pytest.raises(ValueError, match=needle):
            parse(bad, 8, 8, 1.0)


def test_schedule_applies_and_removes() -> None:
    faults = [parse("compute:rank=1,factor=2,start=10s,end=20s", 4, 4, 1.0),
              parse("compute:rank=1,factor=3,start=15s,end=30s", 4, 4, 1.0),
              parse("link:host=2,factor=5,start=5s,end=12s", 4, 4, 1.0)]
    s = Schedule(faults, 4, 4)
    comp, link, started, _ = s.at(6.0)
    assert comp.tolist() == [1, 1, 1, 1] and link.tolist() == [1, 1, 5, 1]
    assert len(started) == 1
    comp, link, _, ended = s.at(16.0)
    assert comp.tolist() == [1, 6, 1, 1] and link.tolist() == [1, 1, 1, 1]  # they compose
    assert [f.kind for f in ended] == ["link"]
    comp, _, _, _ = s.at(40.0)
    assert comp.tolist() == [1, 1, 1, 1]


def test_draw_events_gives_exactly_k_fail_slows_within_the_window() -> None:
    from stalwart.simulate.faults import draw_events

    fs = draw_events(np.random.default_rng(0), 12, 1000, 8, 7200.0)
    slow = [f for f in fs if f.kind != "stop"]
    assert len(slow) == 12 and all(0.0 <= f.start_s < 7200.0 for f in slow)
    assert {f.kind for f in slow} <= {"compute", "link"}
