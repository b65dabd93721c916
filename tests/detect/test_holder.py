"""The monitor's held steps in C (``Holder``, detect/_native/channels.c) against the Python
reference (``monitor.PyHolder``): the same answers, counters, buffer and clock reads on a
random sequence of hints, pushes, takes and switches."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from stalwart.detect import monitor
from stalwart.detect.alarms import IterSample
from stalwart.detect.monitor import PyHolder

pytestmark = pytest.mark.skipif(monitor._Holder is PyHolder, reason="channels.c not built")


def _hint(rng: np.random.Generator, k: int) -> Any:
    m: dict[str, Any] = {"step_time": 0.1 + k, "compute_time": 0.08, "comm_time": 0.02 * k}
    r = rng.random()
    if r < 0.1:
        del m[str(rng.choice(list(m)))]
    elif r < 0.2:
        m[str(rng.choice(list(m)))] = None
    elif r < 0.25:
        return None
    elif r < 0.3:
        return list(m.items())  # not a dict
    return m


def test_the_native_holder_equals_the_reference() -> None:
    rng = np.random.default_rng(0)
    clocks = [itertools.count(), itertools.count()]
    samplers = [SimpleNamespace(last_hint=None) for _ in clocks]
    hs = [cls(3, sp, lambda c=c: float(next(c)))
          for cls, sp, c in zip((monitor._Holder, PyHolder), samplers, clocks, strict=True)]
    held = 0
    for k in range(3000):
        r = rng.random()
        if r < 0.6:
            m = _hint(rng, k)
            got = [h.hold(k, m) for h in hs]
            assert got[0] == got[1]
            held += got[0]
        elif r < 0.7:
            for h in hs:
                h.push(k, float(k), 0.5, 0.25)
        elif r < 0.75:
            assert hs[0].take() == hs[1].take()
        elif r < 0.8:
            got = [h.samples(IterSample) for h in hs]
            assert got[0] == got[1]
            assert all(type(s) is IterSample and type(s.seconds) is float for s in got[0])
        elif r < 0.9:
            due = int(rng.integers(0, 12))
            for h in hs:
                h.due_at = h.checks + due
        else:
            on = bool(rng.random() < 0.8)
            for h in hs:
                h.on = on
        for a in ("n", "cap", "checks", "due_at", "held_steps", "on"):
            assert getattr(hs[0], a) == getattr(hs[1], a), a
        assert samplers[0].last_hint == samplers[1].last_hint
    assert held > 100


def test_hold_keeps_the_objects_it_was_given() -> None:
    """The step and the three times as given (converted when taken), the dict's own
    references not needed after the call."""
    sampler = SimpleNamespace(last_hint=None)
    h = monitor._Holder(2, sampler, lambda: 1.5)
    h.due_at = 10
    step = 10 ** 30  # (not a C integer)
    assert h.hold(step, {"step_time": np.float32(0.25), "compute_time": 1, "comm_time": 0.0})
    assert sampler.last_hint == 1.5 and h.checks == 1 and h.held_steps == 1
    (got,) = h.take()
    assert got[0] is step and type(got[1]) is np.float32 and got[2] == 1 and h.n == 0


def test_samples_converts_the_times_as_float_does() -> None:
    """``samples``: the step as given, the times as ``float`` makes them; a time ``float``
    refuses raises, the buffer emptied all the same (as ``take`` then the conversion)."""
    for cls in (monitor._Holder, PyHolder):
        h = cls(2, SimpleNamespace(last_hint=None), lambda: 0.0)
        step = 10 ** 30
        h.push(step, np.float32(0.25), 1, 0.5)
        (got,) = h.samples(IterSample)
        assert type(got) is IterSample and got == (step, 0.25, 1.0, 0.5)
        assert got.key is step and all(type(x) is float for x in got[1:]) and h.n == 0
        h.push(1, "x", 1.0, 1.0)
        with pytest.raises((TypeError, ValueError)):
            h.samples(IterSample)
        assert h.n == 0


def test_a_monitor_on_either_holder_takes_the_same_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    out = []
    for cls in (monitor._Holder, PyHolder):
        monkeypatch.setattr(monitor, "_Holder", cls)
        mon = monitor.Monitor(rank=0, world=1, check_every=8)
        assert type(mon._holder) is cls
        held = []
        for k in range(100):
            t = 0.1 * (1.5 if k >= 60 else 1.0)
            mon.step(k, {"step_time": t, "compute_time": 0.8 * t, "comm_time": 0.2 * t})
            held.append(mon._n_held)
        mon.close()
        out.append((held, list(mon.samples), mon._checks, mon.stats()["held_steps"],
                    mon.report()))
    assert out[0] == out[1] and max(out[0][0]) == 7
